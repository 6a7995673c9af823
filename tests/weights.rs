//! Model weights end to end (docs/WEIGHTS.md): safetensors files generated here by
//! hand, published into real `kvpoold` processes on loopback and loaded back through the client
//! library and the `kvpool weights` CLI. A round trip on one node and on three, a sharded
//! checkpoint, a corrupted copy, a node killed mid-load, quota exhaustion, a partial hit,
//! re-replication after a drain and a crash. Sizes are small except where size is the point;
//! every wait is bounded.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cluster::{cfg, drain, serving, wait_view};
use common::{temp_dir, Node};
use kvpool::placement::NodeState;
use kvpool::weights::{chunk_key, Manifest};
use kvpool_client::weights::{PublishOptions, Sources, Weights, WeightsError};
use kvpool_client::{Client, ErrorCode, SameHost};

/// Gossip fast enough for short tests, and a down-detection slow enough that a busy 2-core
/// machine does not mark live nodes down (which moves pinned objects around for nothing).
const HEARTBEAT: &[&str] = &["--heartbeat-ms", "100", "--down-after-ms", "2000"];

/// At most one multi-node cluster of this file runs at a time: six daemons on two cores
/// stall each other's heartbeats.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

// ---------------------------------------------------------------------------------------------
// Safetensors files, written by hand.

/// A tensor to generate: name, dtype, shape, bytes per element (a whole number for the dtypes
/// used here).
struct Spec {
    name: &'static str,
    dtype: &'static str,
    shape: Vec<u64>,
    elem: u64,
}

fn spec(name: &'static str, dtype: &'static str, shape: &[u64]) -> Spec {
    let elem = match dtype {
        "BOOL" | "U8" | "I8" => 1,
        "F16" | "BF16" | "I16" => 2,
        "F32" | "I32" => 4,
        "F64" | "I64" => 8,
        other => panic!("no element size for {other}"),
    };
    Spec {
        name,
        dtype,
        shape: shape.to_vec(),
        elem,
    }
}

/// A generated tensor: its name, shape, element size and bytes.
#[derive(Clone)]
struct Tensor {
    name: String,
    shape: Vec<u64>,
    elem: u64,
    bytes: Vec<u8>,
}

/// Deterministic pseudo-random bytes (xorshift64, eight bytes a step: fast in debug builds).
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Writes a safetensors file: the 8-byte little-endian header length, the JSON header padded
/// with spaces to a multiple of 8, then the tensors' bytes in order. Returns the tensors.
fn write_safetensors(path: &Path, specs: &[Spec], seed: u64) -> Vec<Tensor> {
    let mut header = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    let mut data = Vec::new();
    let mut tensors = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        let len = s.shape.iter().product::<u64>() * s.elem;
        let bytes = noise(seed * 1000 + i as u64, len as usize);
        let begin = data.len();
        data.extend_from_slice(&bytes);
        let shape: Vec<String> = s.shape.iter().map(u64::to_string).collect();
        header.push_str(&format!(
            r#","{}":{{"dtype":"{}","shape":[{}],"data_offsets":[{},{}]}}"#,
            s.name,
            s.dtype,
            shape.join(","),
            begin,
            data.len()
        ));
        tensors.push(Tensor {
            name: s.name.to_string(),
            shape: s.shape.clone(),
            elem: s.elem,
            bytes,
        });
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend_from_slice(&data);
    std::fs::write(path, file).unwrap();
    tensors
}

/// A small model of many dtypes and shapes, a zero-sized tensor and a scalar among them.
fn small_specs() -> Vec<Spec> {
    vec![
        spec("embed.weight", "F32", &[64, 48]),
        spec("layers.0.attn.qkv", "BF16", &[96, 40]),
        spec("layers.0.norm", "F16", &[40]),
        spec("layers.0.mlp.up", "I8", &[33, 100]),
        spec("layers.0.mask", "BOOL", &[7, 3]),
        spec("layers.0.empty", "F32", &[0, 4]),
        spec("lm_head.bias", "F64", &[10]),
        spec("scale", "F32", &[]),
        spec("positions", "I64", &[12, 8, 2]),
    ]
}

/// Bytes of slice `rank` of `world` of `t` along `dim`, cut by hand.
fn slice_by_hand(t: &Tensor, dim: usize, rank: u64, world: u64) -> Vec<u8> {
    let part = t.shape[dim] / world;
    let inner: u64 = t.shape[dim + 1..].iter().product::<u64>() * t.elem;
    let outer: u64 = t.shape[..dim].iter().product();
    let mut out = Vec::new();
    for o in 0..outer {
        let row = o * t.shape[dim] * inner;
        let from = (row + rank * part * inner) as usize;
        out.extend_from_slice(&t.bytes[from..from + (part * inner) as usize]);
    }
    out
}

fn assert_same_file(a: &Path, b: &Path) {
    let (x, y) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    assert!(
        x == y,
        "{} ({} bytes) differs from {} ({} bytes)",
        b.display(),
        y.len(),
        a.display(),
        x.len()
    );
}

// ---------------------------------------------------------------------------------------------
// Nodes and clients.

/// Starts node `id` of a cluster with `memory`, joining through `seed`.
fn start(id: u32, memory: &str, seed: Option<&Node>, extra: &[&str]) -> Node {
    common::cluster::start_node(id, memory, seed, &[HEARTBEAT, extra].concat())
}

/// A config file with a `weights` namespace section (`pinned_replicas`, `quota`).
fn weights_config(section: &str) -> String {
    let p = temp_dir("weights-conf").join("kvpool.toml");
    std::fs::write(&p, format!("[[namespace]]\nname = \"weights\"\n{section}")).unwrap();
    p.to_str().unwrap().to_string()
}

/// `n` nodes, node ids 0.., every one serving in every node's view; held with the file's
/// one-cluster-at-a-time guard.
async fn cluster(
    n: u32,
    memory: &str,
    conf: &str,
) -> (Vec<Node>, tokio::sync::MutexGuard<'static, ()>) {
    let serial = SERIAL.lock().await;
    let extra = ["--config", conf];
    let first = start(0, memory, None, &extra);
    let mut nodes = vec![];
    for id in 1..n {
        nodes.push(start(id, memory, Some(&first), &extra));
    }
    nodes.insert(0, first);
    for node in &nodes {
        let c = connect(node, SameHost::Off).await;
        wait_view(c.client(), "every node serving", |v| {
            serving(v) == n as usize
        })
        .await;
    }
    // And the view settled: pinned objects written while the nodes' views still differ can
    // be lost (docs/WEIGHTS.md, "Known limits").
    let mut clients = Vec::new();
    for node in &nodes {
        clients.push(connect(node, SameHost::Off).await);
    }
    let t = Instant::now();
    let mut last = Vec::new();
    let mut since = Instant::now();
    while since.elapsed() < Duration::from_millis(1500) {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the view never settled"
        );
        let mut stamps = Vec::new();
        for c in &clients {
            stamps.push(c.client().view().await.unwrap().stamp());
        }
        if stamps != last || stamps.iter().any(|s| *s != stamps[0]) {
            last = stamps;
            since = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (nodes, serial)
}

async fn connect(n: &Node, same_host: SameHost) -> Weights {
    connect_with(n, cfg(same_host)).await
}

async fn connect_with(n: &Node, cfg: kvpool_client::ClientConfig) -> Weights {
    let c = Client::connect(&n.tcp_url(), cfg).await.unwrap();
    Weights::new(&c, kvpool::weights::DEFAULT_NAMESPACE).unwrap()
}

/// A client for tens of MiB per request in a debug build on a busy machine: a request that
/// times out loses its node for the client (a copy of a pinned put not made, a load's chunk
/// taken from its replica), which is not what these tests are about.
fn patient() -> kvpool_client::ClientConfig {
    kvpool_client::ClientConfig {
        timeout: Duration::from_secs(60),
        ..cfg(SameHost::Off)
    }
}

fn opts(chunk_size: u64) -> PublishOptions {
    PublishOptions {
        chunk_size,
        replicas: None,
    }
}

/// Writes a model of `specs` (bytes from `seed`) into a fresh directory and publishes it as
/// `name` in chunks of `chunk_size`: the directory, the tensors written and the manifest.
async fn publish_generated(
    w: &Weights,
    name: &str,
    specs: &[Spec],
    seed: u64,
    chunk_size: u64,
) -> (PathBuf, Vec<Tensor>, Manifest) {
    let dir = temp_dir(&format!("weights-{name}"));
    let src = dir.join("model.safetensors");
    let tensors = write_safetensors(&src, specs, seed);
    let m = w.publish(name, &[src], &opts(chunk_size)).await.unwrap();
    (dir, tensors, m)
}

/// Every key of the weights namespace under `prefix`.
async fn keys(w: &Weights, prefix: &[u8]) -> Vec<Vec<u8>> {
    w.client().keys_with_prefix(prefix).await.unwrap()
}

fn chunk_keys(m: &Manifest) -> Vec<Vec<u8>> {
    m.chunks().map(|c| chunk_key(&m.name, &c)).collect()
}

/// Every tensor of `m` loaded and compared with what was generated.
async fn assert_loads(
    w: &Weights,
    m: &Manifest,
    want: &[Tensor],
) -> kvpool_client::weights::LoadReport {
    let (got, report) = w.load_all(m, None).await.unwrap();
    assert_eq!(got.len(), want.len());
    for (g, t) in got.iter().zip(want) {
        assert!(g == &t.bytes, "tensor {}: wrong bytes", t.name);
    }
    report
}

// ---------------------------------------------------------------------------------------------
// 1. Round trip.

/// Publish, list, write back, load each tensor and slices of two, remove: on `w`.
async fn round_trip(w: &Weights) {
    let dir = temp_dir("weights-rt");
    let src = dir.join("model.safetensors");
    let tensors = write_safetensors(&src, &small_specs(), 1);
    let config = dir.join("config.json");
    std::fs::write(&config, br#"{"architectures":["Test"],"hidden_size":48}"#).unwrap();
    let m = w
        .publish("test/rt-model", &[src.clone(), config.clone()], &opts(4096))
        .await
        .unwrap();
    assert_eq!(m.tensor_count(), tensors.len());
    assert_eq!(
        m.tensor_bytes(),
        tensors.iter().map(|t| t.bytes.len() as u64).sum::<u64>()
    );
    assert!(m.chunks().count() > tensors.len(), "large tensors were cut");
    assert_eq!(w.list().await.unwrap(), vec!["test/rt-model".to_string()]);
    assert_eq!(w.require("test/rt-model").await.unwrap(), m);

    // Written back byte for byte, the companion file too.
    let out = dir.join("out");
    let r = w.write_files(&m, &out, None).await.unwrap();
    assert_eq!(r.chunks_from_files, 0);
    assert_eq!(r.chunks_from_pool, m.chunks().count());
    assert_same_file(&src, &out.join("model.safetensors"));
    assert_same_file(&config, &out.join("config.json"));

    // Each tensor by name, and slices along dimensions 0 and 1.
    for t in &tensors {
        let got = w.tensor(&m, &t.name, None).await.unwrap();
        assert!(got == t.bytes, "tensor {}", t.name);
    }
    let by_name = |n: &str| tensors.iter().find(|t| t.name == n).unwrap();
    for (name, dim, world) in [
        ("embed.weight", 0, 4),
        ("embed.weight", 1, 4),
        ("layers.0.attn.qkv", 0, 3),
        ("layers.0.attn.qkv", 1, 2),
        ("positions", 1, 2),
        ("positions", 2, 2),
    ] {
        let t = by_name(name);
        for rank in 0..world {
            let (bytes, shape) = w.slice(&m, name, dim, rank, world).await.unwrap();
            let mut want_shape = t.shape.clone();
            want_shape[dim] /= world;
            assert_eq!(shape, want_shape, "{name} dim {dim} rank {rank}/{world}");
            assert!(
                bytes == slice_by_hand(t, dim, rank, world),
                "{name} dim {dim} rank {rank}/{world}: wrong bytes"
            );
        }
    }
    assert!(matches!(
        w.slice(&m, "embed.weight", 1, 0, 5).await,
        Err(WeightsError::Format(_))
    ));
    assert!(matches!(
        w.tensor(&m, "no.such.tensor", None).await,
        Err(WeightsError::NoTensor(_))
    ));

    // Removed: no manifest, no piece left.
    assert!(!keys(w, b"w/").await.is_empty());
    assert!(w.remove("test/rt-model").await.unwrap());
    assert!(keys(w, b"w/").await.is_empty(), "pieces left after remove");
    assert!(keys(w, b"manifest/").await.is_empty());
    assert!(w.manifest("test/rt-model").await.unwrap().is_none());
    assert!(w.list().await.unwrap().is_empty());
    assert!(!w.remove("test/rt-model").await.unwrap());
    assert!(matches!(
        w.require("test/rt-model").await,
        Err(WeightsError::NotFound(_))
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_round_trips_on_one_node() {
    let n = Node::start("64MiB", &[]);
    for same_host in [SameHost::Auto, SameHost::Off] {
        round_trip(&connect(&n, same_host).await).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_round_trips_on_three_nodes_from_any_node() {
    let (nodes, _serial) = cluster(3, "64MiB", &weights_config("pinned_replicas = 2\n")).await;
    round_trip(&connect(&nodes[0], SameHost::Auto).await).await;
    round_trip(&connect(&nodes[2], SameHost::Off).await).await;
}

// ---------------------------------------------------------------------------------------------
// 2. A sharded checkpoint.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_checkpoint_publishes_from_its_index_and_writes_back_identical() {
    let n = Node::start("64MiB", &[]);
    let w = connect(&n, SameHost::Auto).await;
    let dir = temp_dir("weights-sharded");
    let shards = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    let a = write_safetensors(
        &dir.join(shards[0]),
        &[
            spec("model.embed.weight", "F32", &[32, 16]),
            spec("model.layers.0.q.weight", "BF16", &[16, 16]),
        ],
        2,
    );
    let b = write_safetensors(
        &dir.join(shards[1]),
        &[
            spec("model.layers.1.q.weight", "BF16", &[16, 16]),
            spec("model.norm.weight", "F16", &[16]),
            spec("lm_head.weight", "F32", &[32, 16]),
        ],
        3,
    );
    let mut map = Vec::new();
    for (t, f) in a
        .iter()
        .map(|t| (t, shards[0]))
        .chain(b.iter().map(|t| (t, shards[1])))
    {
        map.push(format!("\"{}\":\"{f}\"", t.name));
    }
    let total: usize = a.iter().chain(&b).map(|t| t.bytes.len()).sum();
    let index = dir.join("model.safetensors.index.json");
    std::fs::write(
        &index,
        format!(
            "{{\"metadata\":{{\"total_size\":{total}}},\"weight_map\":{{{}}}}}\n",
            map.join(",")
        ),
    )
    .unwrap();

    let m = w
        .publish("sharded", std::slice::from_ref(&index), &opts(1024))
        .await
        .unwrap();
    let names: Vec<&str> = m.files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, shards, "both shards, in the index's order");
    assert_eq!(m.extra.len(), 1, "the index itself is kept");
    assert_eq!(m.tensor_count(), 5);

    let out = dir.join("out");
    w.write_files(&m, &out, None).await.unwrap();
    for f in shards.iter().chain(&["model.safetensors.index.json"]) {
        assert_same_file(&dir.join(f), &out.join(f));
    }
    // A tensor of the second shard, by name.
    assert!(w.tensor(&m, "lm_head.weight", None).await.unwrap() == b[2].bytes);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// 3. A corrupted copy.

/// The segment file that holds `addr` among `nodes` (node ids are their index), and the file
/// offset of the address's first byte.
fn segment_place(nodes: &[Node], addr: &kvpool::GlobalAddr) -> (PathBuf, u64) {
    let n = &nodes[addr.node.0 as usize];
    let path = n
        .dir
        .join(kvpool::segment::segment_file_name(addr.node, addr.segment));
    let f = std::fs::File::open(&path)
        .unwrap_or_else(|e| panic!("segment file {}: {e}", path.display()));
    let mut header = [0u8; 56];
    f.read_exact_at(&mut header, 0).unwrap();
    let layout = kvpool::segment::SegmentLayout::decode(&header, u64::MAX).unwrap();
    assert_eq!((layout.node, layout.id), (addr.node, addr.segment));
    (path, layout.data_offset + addr.offset)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_copy_is_detected_and_read_from_the_replica() {
    let (nodes, _serial) = cluster(2, "64MiB", &weights_config("pinned_replicas = 2\n")).await;
    let w = connect(&nodes[0], SameHost::Off).await;
    let (dir, tensors, m) = publish_generated(&w, "corrupt", &small_specs(), 4, 4096).await;

    // The first copy of one chunk of the first tensor, and where its bytes lie on its node.
    let key = chunk_key(&m.name, &m.chunks().nth(1).unwrap());
    let first = w
        .client()
        .lease_replica(&[&key], 0, 0)
        .await
        .unwrap()
        .remove(0)
        .expect("the chunk's first copy");
    let second = w
        .client()
        .lease_replica(&[&key], 0, 1)
        .await
        .unwrap()
        .remove(0);
    let second = second.expect("the chunk's second copy");
    assert_ne!(
        first.addr.node, second.addr.node,
        "two nodes hold the chunk"
    );
    let (path, at) = segment_place(&nodes, &first.addr);
    let seg = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let mut bytes = vec![0u8; first.addr.len as usize];
    seg.read_exact_at(&mut bytes, at).unwrap();
    assert_eq!(
        kvpool::checksum::checksum(&bytes),
        first.checksum,
        "found the copy's bytes"
    );
    for b in bytes.iter_mut().skip(100).step_by(997) {
        *b ^= 0x5a;
    }
    seg.write_all_at(&bytes, at).unwrap();
    // The node still vouches for the old checksum: only the bytes are wrong.
    let again = w.client().lease_replica(&[&key], 0, 0).await.unwrap()[0].unwrap();
    assert_eq!(again.checksum, first.checksum);

    // Over a socket (the received bytes are hashed) and on the same host (the mapped copy is
    // checked in the same pass): the right bytes, the chunk from its other copy.
    for same_host in [SameHost::Off, SameHost::Auto] {
        let w = connect(&nodes[0], same_host).await;
        let report = assert_loads(&w, &m, &tensors).await;
        assert!(
            report.chunks_from_replicas >= 1,
            "{same_host:?}: the corrupted chunk came from its replica: {report:?}"
        );
        assert_eq!(report.chunks_from_files, 0);
        assert!(w.tensor(&m, &tensors[0].name, None).await.unwrap() == tensors[0].bytes);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// 4. A node lost mid-load, 7. re-replication after a crash.

/// Polls `stats` (at most 20 s) until every chunk has all its copies; returns the last stats.
async fn wait_replicated(
    w: &Weights,
    m: &Manifest,
    what: &str,
) -> kvpool_client::weights::WeightStats {
    let t = Instant::now();
    loop {
        let s = w.stats(m).await;
        if let Ok(s) = &s {
            if s.under_replicated == 0 && s.missing == 0 {
                println!(
                    "{what}: every chunk has {} copies after {:?}",
                    s.replicas,
                    t.elapsed()
                );
                return s.clone();
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{what}: chunks never got their copies back: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A model of `mib` MiB in tensors of 4 MiB at most.
fn big_specs(mib: u64) -> Vec<Spec> {
    const NAMES: [&str; 32] = [
        "t00", "t01", "t02", "t03", "t04", "t05", "t06", "t07", "t08", "t09", "t10", "t11", "t12",
        "t13", "t14", "t15", "t16", "t17", "t18", "t19", "t20", "t21", "t22", "t23", "t24", "t25",
        "t26", "t27", "t28", "t29", "t30", "t31",
    ];
    assert!(mib / 2 <= NAMES.len() as u64);
    // Pairs of tensors: 1536 x 512 F32 (3 MiB) and 512 x 512 F32 (1 MiB).
    (0..mib as usize / 4 * 2)
        .map(|i| {
            if i % 2 == 0 {
                spec(NAMES[i], "F32", &[1536, 512])
            } else {
                spec(NAMES[i], "F32", &[512, 512])
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_mid_load_leaves_the_load_complete_and_its_chunks_re_replicated() {
    let (mut nodes, _serial) = cluster(3, "160MiB", &weights_config("pinned_replicas = 2\n")).await;
    let w = connect_with(&nodes[0], patient()).await;
    // 8 MiB in 256 KiB chunks: see `a_large_model_keeps_every_chunk_in_two_copies` for why
    // not the 64 MiB in 1 MiB chunks the load is meant to have.
    let (dir, tensors, m) = publish_generated(&w, "big", &big_specs(8), 5, 256 << 10).await;
    assert_eq!(m.chunks().count(), 32);
    let s = w.stats(&m).await.unwrap();
    assert_eq!(
        (s.replicas, s.under_replicated, s.missing),
        (2, 0, 0),
        "{s:?}"
    );
    let on_2 = s.nodes.iter().find(|n| n.0 == 2).map_or(0, |n| n.1);
    assert!(on_2 > 5, "node 2 holds a share of the copies: {s:?}");

    // Loads back to back in a task, each checked; node 2 is killed while the second runs.
    let started = Arc::new(Mutex::new(Vec::<(Instant, Option<Instant>)>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<usize>();
    let loader = {
        let (w, m, started, stop) = (w.clone(), m.clone(), started.clone(), stop.clone());
        let want: Vec<Vec<u8>> = tensors.iter().map(|t| t.bytes.clone()).collect();
        tokio::spawn(async move {
            let mut reports = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let i = {
                    let mut s = started.lock().unwrap();
                    s.push((Instant::now(), None));
                    s.len() - 1
                };
                let _ = tx.send(i);
                let (got, report) = w.load_all(&m, None).await.unwrap_or_else(|e| {
                    panic!("load {i} failed: {e}");
                });
                started.lock().unwrap()[i].1 = Some(Instant::now());
                for (k, (g, t)) in got.iter().zip(&want).enumerate() {
                    assert!(g == t, "load {i}: tensor {k} has wrong bytes");
                }
                reports.push(report);
            }
            reports
        })
    };
    while rx.recv().await != Some(1) {}
    tokio::time::sleep(Duration::from_millis(30)).await;
    let mut child = nodes[2].child.take().unwrap();
    child.kill().unwrap(); // SIGKILL
    let killed = Instant::now();
    child.wait().unwrap();
    // Let loads run on until one has started after node 2 was marked down.
    wait_view(w.client(), "node 2 down", |v| {
        v.node(kvpool::NodeId(2))
            .is_some_and(|n| n.state == NodeState::Down)
    })
    .await;
    let down = Instant::now();
    let t = Instant::now();
    while started.lock().unwrap().last().unwrap().0 < down {
        assert!(t.elapsed() < Duration::from_secs(60), "loads stalled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let reports = tokio::time::timeout(Duration::from_secs(60), loader)
        .await
        .expect("the loads finish")
        .unwrap();
    let spans = started.lock().unwrap().clone();
    println!(
        "loads (start, end) relative to the kill: {:?}",
        spans
            .iter()
            .map(|(s, e)| {
                (
                    s.saturating_duration_since(killed).as_millis() as i64
                        - killed.saturating_duration_since(*s).as_millis() as i64,
                    e.map(|e| {
                        e.saturating_duration_since(killed).as_millis() as i64
                            - killed.saturating_duration_since(e).as_millis() as i64
                    }),
                )
            })
            .collect::<Vec<_>>()
    );
    println!("reports: {reports:?}");
    assert!(
        spans
            .iter()
            .any(|(s, e)| *s < killed && e.is_some_and(|e| e > killed)),
        "a load was running when node 2 was killed: {spans:?}"
    );
    assert!(
        reports.iter().any(|r| r.chunks_from_replicas > 0),
        "some chunks came from their second copy: {reports:?}"
    );
    assert!(reports.iter().all(|r| r.chunks_from_files == 0));

    // 7. The survivors' movers give every chunk its two copies again.
    let s = wait_replicated(&w, &m, "after a SIGKILL").await;
    assert_eq!(s.replicas, 2);
    assert!(s.nodes.iter().all(|n| n.0 != 2), "{s:?}");
    assert_loads(&w, &m, &tensors).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// 64 MiB in 1 MiB chunks on three nodes: every chunk is in the pool as soon as `publish`
/// returns, and in two copies soon after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_model_keeps_every_chunk_in_two_copies() {
    let (nodes, _serial) = cluster(3, "160MiB", &weights_config("pinned_replicas = 2\n")).await;
    let w = connect_with(&nodes[0], patient()).await;
    let (dir, tensors, m) = publish_generated(&w, "large", &big_specs(64), 13, 1 << 20).await;
    assert_eq!(m.chunks().count(), 64);
    let listed = keys(&w, b"w/").await.len();
    let s = w.stats(&m).await.unwrap();
    assert_eq!(
        (listed, s.replicas, s.missing),
        (64, 2, 0),
        "every chunk key listed and in a copy: {s:?}"
    );
    // A put counts as stored once one owner stored it; an owner that refused (busy, or a
    // view that just moved) gets its copy from the mover.
    wait_replicated(&w, &m, "after publishing").await;
    assert_loads(&w, &m, &tensors).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_after_a_node_was_killed_completes_from_replicas() {
    let (mut nodes, _serial) = cluster(3, "64MiB", &weights_config("pinned_replicas = 2\n")).await;
    let w = connect(&nodes[0], SameHost::Off).await;
    let (dir, tensors, m) = publish_generated(&w, "killed", &big_specs(8), 6, 256 << 10).await;
    // Killed before the load, before the others notice: the first copies there are unreachable.
    let mut child = nodes[1].child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let r = assert_loads(&w, &m, &tensors).await;
    assert!(r.chunks_from_replicas > 0, "{r:?}");
    assert_eq!(r.chunks_from_files, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// 5. Quota exhaustion.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_over_the_quota_is_refused_whole_and_one_that_fits_publishes() {
    let conf = weights_config("quota = \"4MiB\"\n");
    let n = Node::start("64MiB", &["--config", &conf]);
    let w = connect(&n, SameHost::Auto).await;
    let dir = temp_dir("weights-quota");
    let big = dir.join("big.safetensors");
    write_safetensors(&big, &big_specs(8), 7);
    let err = w
        .publish("too-big", std::slice::from_ref(&big), &opts(1 << 20))
        .await
        .unwrap_err();
    println!("{err}");
    match &err {
        WeightsError::Store { code, .. } => {
            assert_eq!(*code, ErrorCode::QuotaExceeded, "{err}")
        }
        e => panic!("expected a store error, got {e}"),
    }
    assert!(w.manifest("too-big").await.unwrap().is_none());
    assert!(keys(&w, b"w/").await.is_empty(), "chunks left behind");
    assert!(keys(&w, b"").await.is_empty(), "anything left behind");
    // The quota is whole again: a model that fits publishes and loads.
    let small = dir.join("small.safetensors");
    let tensors = write_safetensors(&small, &big_specs(4)[1..2], 8);
    let m = w.publish("fits", &[small], &opts(1 << 20)).await.unwrap();
    assert_loads(&w, &m, &tensors).await;
    assert_eq!(w.list().await.unwrap(), vec!["fits".to_string()]);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// 6. A partial hit.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_hit_reads_only_the_missing_chunks_from_the_files() {
    let n = Node::start("64MiB", &[]);
    let w = connect(&n, SameHost::Auto).await;
    let dir = temp_dir("weights-partial");
    let src = dir.join("model.safetensors");
    let tensors = write_safetensors(&src, &small_specs(), 9);
    let m = w
        .publish("partial", std::slice::from_ref(&src), &opts(1024))
        .await
        .unwrap();
    let all = chunk_keys(&m);
    let gone: Vec<&[u8]> = all.iter().step_by(3).map(|k| &k[..]).collect();
    assert_eq!(
        w.client().batch_remove(&gone).await.unwrap(),
        gone.len() as u64
    );
    assert!(matches!(
        w.load_all(&m, None).await,
        Err(WeightsError::Missing { missing, wanted }) if missing == gone.len() && wanted == all.len()
    ));

    let sources = Sources::files(&[src]);
    let (got, r) = w.load_all(&m, Some(&sources)).await.unwrap();
    for (g, t) in got.iter().zip(&tensors) {
        assert!(g == &t.bytes, "tensor {}", t.name);
    }
    assert_eq!(r.chunks_from_files, gone.len(), "{r:?}");
    assert_eq!(r.chunks_from_pool, all.len() - gone.len(), "{r:?}");
    // The missing chunks were put back: the next load finds every one in the pool.
    let r = assert_loads(&w, &m, &tensors).await;
    assert_eq!(
        (r.chunks_from_pool, r.chunks_from_files),
        (all.len(), 0),
        "{r:?}"
    );

    // A source file that is not the published one is refused, not used.
    w.client().batch_remove(&gone).await.unwrap();
    let other = dir.join("other").join("model.safetensors");
    std::fs::create_dir_all(other.parent().unwrap()).unwrap();
    write_safetensors(&other, &small_specs(), 10);
    assert!(matches!(
        w.load_all(&m, Some(&Sources::files(&[other]))).await,
        Err(WeightsError::SourceChanged { .. })
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// 7. Re-replication after a drain.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_node_leaves_every_chunk_with_its_copies() {
    let (mut nodes, _serial) = cluster(3, "64MiB", &weights_config("pinned_replicas = 2\n")).await;
    let w = connect(&nodes[0], SameHost::Off).await;
    let (dir, tensors, m) = publish_generated(&w, "drained", &small_specs(), 11, 512).await;
    let s = w.stats(&m).await.unwrap();
    assert!(s.nodes.iter().any(|n| n.0 == 1 && n.1 > 5), "{s:?}");

    drain(&mut nodes, 1).await;
    wait_view(w.client(), "node 1 down", |v| {
        v.node(kvpool::NodeId(1))
            .is_some_and(|n| n.state == NodeState::Down)
    })
    .await;
    let s = wait_replicated(&w, &m, "after a drain").await;
    assert!(s.nodes.iter().all(|n| n.0 != 1), "{s:?}");
    let r = assert_loads(&w, &m, &tensors).await;
    assert_eq!(
        r.chunks_from_replicas, 0,
        "every first copy is in place: {r:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// 8. The CLI.

fn kvpool(n: &Node, args: &[&str]) -> std::process::Output {
    std::process::Command::new(common::bin("kvpool"))
        .args(["-e", &n.tcp_url()])
        .args(args)
        .output()
        .unwrap()
}

fn stdout(o: &std::process::Output) -> String {
    assert!(o.status.success(), "{o:?}");
    String::from_utf8(o.stdout.clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_puts_lists_inspects_gets_and_removes_a_model() {
    let n = Node::start("64MiB", &[]);
    let dir = temp_dir("weights-cli");
    let src = dir.join("model.safetensors");
    let tensors = write_safetensors(&src, &small_specs(), 12);
    let config = dir.join("config.json");
    std::fs::write(&config, b"{\"hidden_size\": 48}\n").unwrap();
    let (s, c) = (src.to_str().unwrap(), config.to_str().unwrap());

    let put = stdout(&kvpool(
        &n,
        &[
            "weights",
            "put",
            "org/cli-model",
            s,
            c,
            "--chunk-size",
            "4KiB",
            "--replicas",
            "2",
        ],
    ));
    let bytes: usize = tensors.iter().map(|t| t.bytes.len()).sum();
    assert!(
        put.contains(&format!(
            "{} tensors, {bytes} bytes in 1 files (+1 other)",
            tensors.len()
        )),
        "{put}"
    );
    // Asking for copies the namespace does not keep is refused, clearly.
    let three = kvpool(&n, &["weights", "put", "other", s, "--replicas", "3"]);
    assert_eq!(three.status.code(), Some(2), "{three:?}");
    assert!(
        String::from_utf8_lossy(&three.stderr).contains("pinned_replicas = 3"),
        "{three:?}"
    );

    assert_eq!(stdout(&kvpool(&n, &["weights", "ls"])), "org/cli-model\n");

    let json = stdout(&kvpool(
        &n,
        &["weights", "stats", "org/cli-model", "--json"],
    ));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let w = connect(&n, SameHost::Off).await;
    let m = w.require("org/cli-model").await.unwrap();
    assert_eq!(v["name"], "org/cli-model", "{json}");
    assert_eq!(v["tensors"], tensors.len(), "{json}");
    assert_eq!(v["tensor_bytes"], bytes, "{json}");
    assert_eq!(v["files"], 1, "{json}");
    assert_eq!(v["extra_files"], 1, "{json}");
    assert_eq!(v["chunk_size"], 4096, "{json}");
    assert_eq!(v["chunks"], m.chunks().count(), "{json}");
    assert_eq!(v["replicas"], 1, "one node keeps one copy: {json}");
    assert_eq!(v["under_replicated"], 0, "{json}");
    assert_eq!(v["missing"], 0, "{json}");
    assert_eq!(v["nodes"][0]["chunks"], m.chunks().count(), "{json}");
    assert_eq!(v["nodes"][0]["bytes"], bytes, "{json}");
    let text = stdout(&kvpool(&n, &["weights", "stats", "org/cli-model"]));
    assert!(text.contains("under-replicated: 0, missing: 0"), "{text}");

    let out = dir.join("out");
    let got = stdout(&kvpool(
        &n,
        &[
            "weights",
            "get",
            "org/cli-model",
            "--out",
            out.to_str().unwrap(),
        ],
    ));
    assert!(
        got.contains(&format!("{bytes} bytes from the pool")),
        "{got}"
    );
    assert_same_file(&src, &out.join("model.safetensors"));
    assert_same_file(&config, &out.join("config.json"));

    // With chunks gone, `get --from` reads them from the original files.
    let gone: Vec<Vec<u8>> = chunk_keys(&m).into_iter().step_by(2).collect();
    let refs: Vec<&[u8]> = gone.iter().map(|k| &k[..]).collect();
    w.client().batch_remove(&refs).await.unwrap();
    let out2 = dir.join("out2");
    let no_from = kvpool(
        &n,
        &[
            "weights",
            "get",
            "org/cli-model",
            "--out",
            out2.to_str().unwrap(),
        ],
    );
    assert_eq!(no_from.status.code(), Some(2), "{no_from:?}");
    let got = stdout(&kvpool(
        &n,
        &[
            "weights",
            "get",
            "org/cli-model",
            "--out",
            out2.to_str().unwrap(),
            "--from",
            dir.to_str().unwrap(),
        ],
    ));
    assert!(!got.contains(" 0 from files"), "{got}");
    assert_same_file(&src, &out2.join("model.safetensors"));

    assert_eq!(
        stdout(&kvpool(&n, &["weights", "rm", "org/cli-model"])),
        "removed org/cli-model\n"
    );
    assert_eq!(stdout(&kvpool(&n, &["weights", "ls"])), "");
    assert!(keys(&w, b"w/").await.is_empty());
    let again = kvpool(&n, &["weights", "rm", "org/cli-model"]);
    assert_eq!(again.status.code(), Some(1), "{again:?}");
    let missing = kvpool(
        &n,
        &[
            "weights",
            "get",
            "org/cli-model",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert_eq!(missing.status.code(), Some(2), "{missing:?}");
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("no model"),
        "{missing:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// 8. Zero-copy views on the same host.

/// Bytes the weights namespace takes on the node `w` reaches.
async fn weights_used(w: &Weights) -> u64 {
    let s = w.client().stats().await.unwrap();
    s.namespaces
        .iter()
        .find(|n| n.name == kvpool::weights::DEFAULT_NAMESPACE)
        .map_or(0, |n| n.used_bytes)
}

fn every_tensor(m: &Manifest) -> Vec<(usize, usize)> {
    m.files
        .iter()
        .enumerate()
        .flat_map(|(f, file)| (0..file.tensors.len()).map(move |t| (f, t)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn views_read_the_pool_memory_in_place_and_outlive_a_removal() {
    // Idle connections are closed after 500 ms, but not one that holds objects.
    let conf = weights_config("[limits]\nidle_timeout_ms = 500\n");
    let (nodes, _serial) = cluster(1, "64MiB", &conf).await;
    let w = connect(&nodes[0], SameHost::Auto).await;
    // 64 KiB chunks (a whole allocator page each: page aligned), so the 1 MiB tensor is 16
    // chunks stitched into one view; the others are one chunk each.
    let mut specs = small_specs();
    specs.push(spec("layers.0.mlp.down", "F32", &[256, 1024]));
    let (dir, tensors, m) = publish_generated(&w, "views", &specs, 8, 64 << 10).await;
    let which = every_tensor(&m);

    let views = w.view(&m, &which, true).await.unwrap();
    assert_eq!(views.len(), tensors.len());
    assert_eq!(
        views.viewed(),
        tensors.len(),
        "every tensor is on this host"
    );
    assert_eq!(views.connections(), 1);
    for (i, t) in tensors.iter().enumerate() {
        assert!(views.get(i).unwrap() == &t.bytes[..], "tensor {}", t.name);
    }

    // Idle past the timeout, removed, and the pool filled over and over with other objects:
    // the held chunks keep their memory, the views their bytes.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let used = weights_used(&w).await;
    assert!(used > 0);
    assert!(w.remove("views").await.unwrap());
    let other = Client::connect(&nodes[0].tcp_url(), cfg(SameHost::Auto))
        .await
        .unwrap();
    let value = noise(99, 1 << 20);
    for i in 0..160u32 {
        let _ = other.put(format!("filler-{i}").as_bytes(), &value).await;
    }
    for (i, t) in tensors.iter().enumerate() {
        assert!(
            views.get(i).unwrap() == &t.bytes[..],
            "tensor {} after removal",
            t.name
        );
    }
    let data: u64 = tensors.iter().map(|t| t.bytes.len() as u64).sum();
    let held = weights_used(&w).await;
    assert!(
        held >= data && held < used,
        "only the held chunks still take memory (the manifest went): {held} of {used}, {data} of tensors"
    );

    // Dropping the views ends the holds (the daemon sees their connection close).
    drop(views);
    let deadline = Instant::now() + Duration::from_secs(10);
    while weights_used(&w).await > 0 {
        assert!(
            Instant::now() < deadline,
            "the held chunks were never freed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Over a socket there is nothing to view: every tensor is left to a copy (but the empty
    // one, which has no chunk to fetch).
    let m = w
        .publish("views", &[dir.join("model.safetensors")], &opts(64 << 10))
        .await
        .unwrap();
    let remote = connect(&nodes[0], SameHost::Off).await;
    let none = remote.view(&m, &which, true).await.unwrap();
    let empty = tensors.iter().filter(|t| t.bytes.is_empty()).count();
    assert_eq!(none.viewed(), empty);
    assert_eq!(none.connections(), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_view_of_a_corrupted_chunk_is_refused_and_holds_are_bounded() {
    let conf = weights_config("[limits]\nmax_holds_per_connection = 40\n");
    let (nodes, _serial) = cluster(1, "64MiB", &conf).await;
    let w = connect(&nodes[0], SameHost::Auto).await;
    let (dir, tensors, m) = publish_generated(&w, "bad-view", &small_specs(), 5, 64 << 10).await;
    let which = every_tensor(&m);
    let key = chunk_key(&m.name, &m.chunks().next().unwrap());
    let l = w.client().lease(&[&key], 0).await.unwrap()[0].expect("the first chunk");
    let (path, at) = segment_place(&nodes, &l.addr);
    let seg = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    seg.write_all_at(&[0xff ^ tensors[0].bytes[7]], at + 7)
        .unwrap();

    let views = w.view(&m, &which, true).await.unwrap();
    assert!(views.get(0).is_none(), "the corrupted tensor is not viewed");
    assert_eq!(views.viewed(), tensors.len() - 1);
    for (i, t) in tensors.iter().enumerate().skip(1) {
        assert!(views.get(i).unwrap() == &t.bytes[..], "tensor {}", t.name);
    }

    // A connection may hold 40 objects: a view of more chunks than that is refused whole.
    let big = vec![spec("big", "U8", &[41 << 12])];
    let (dir2, _, m2) = publish_generated(&w, "too-many", &big, 6, 4096).await;
    match w.view(&m2, &every_tensor(&m2), true).await {
        Err(WeightsError::Client(e)) => {
            assert_eq!(e.code(), Some(ErrorCode::LimitExceeded), "{e}");
            assert!(
                e.to_string().contains("limits.max_holds_per_connection"),
                "{e}"
            );
        }
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("41 holds on one connection were granted"),
    }
    drop(views);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&dir2);
}

// ---------------------------------------------------------------------------------------------
// 9. Checksums given by the publisher.

/// The checksums a publisher computed once go with its values, and the node still checks
/// them: a value with a wrong sum is refused (`ChecksumMismatch`) and not stored, the others
/// are, over the mapping (several items, or one large) and over the socket (a batch, or one
/// item alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_put_with_their_checksums_are_checked_by_the_node() {
    let n = Node::start("64MiB", &[]);
    for same_host in [SameHost::Auto, SameHost::Off] {
        let w = connect(&n, same_host).await;
        let kv = w.client();
        assert_eq!(kv.is_local(), same_host == SameHost::Auto);
        let tag = format!("{same_host:?}");
        let keys: Vec<Vec<u8>> = (0..3)
            .map(|i| format!("sums/{tag}/{i}").into_bytes())
            .collect();
        let values: Vec<Vec<u8>> = (0..3).map(|i| noise(40 + i, 64 << 10)).collect();
        let mut sums: Vec<u64> = values.iter().map(|v| kvpool::checksum(v)).collect();
        sums[1] ^= 1;
        let items: Vec<(&[u8], &[u8])> = keys
            .iter()
            .zip(&values)
            .map(|(k, v)| (&k[..], &v[..]))
            .collect();
        let codes = kv
            .batch_put_pinned_with_checksums(&items, &sums)
            .await
            .unwrap();
        assert_eq!(
            codes,
            [ErrorCode::Ok, ErrorCode::ChecksumMismatch, ErrorCode::Ok],
            "{tag}"
        );
        assert_eq!(kv.get(&keys[0]).await.unwrap().as_ref(), Some(&values[0]));
        assert_eq!(
            kv.get(&keys[1]).await.unwrap(),
            None,
            "{tag}: refused, not stored"
        );
        assert_eq!(kv.get(&keys[2]).await.unwrap().as_ref(), Some(&values[2]));
        // One item alone (a single put over the socket, a mapped store on the same host).
        let one = [(&keys[1][..], &values[1][..])];
        let codes = kv
            .batch_put_pinned_with_checksums(&one, &[sums[1]])
            .await
            .unwrap();
        assert_eq!(codes, [ErrorCode::ChecksumMismatch], "{tag}");
        assert_eq!(kv.get(&keys[1]).await.unwrap(), None, "{tag}");
        let codes = kv
            .batch_put_pinned_with_checksums(&one, &[sums[1] ^ 1])
            .await
            .unwrap();
        assert_eq!(codes, [ErrorCode::Ok], "{tag}");
        assert_eq!(kv.get(&keys[1]).await.unwrap().as_ref(), Some(&values[1]));
    }
}
