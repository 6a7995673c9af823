//! The RESP door's weights view (docs/WEIGHTS.md, "SGLang's remote loader") on a real cluster
//! of two: a model published with the client is listed and read through one node's door as
//! SGLang's `RedisConnector` reads it, its chunks spread over both nodes (those of the other
//! node reached through the door's forwarding client), and a chunk that fails its checksum
//! makes the GET a miss, never wrong bytes. SGLang itself drives it in
//! python/tests/engines/test_sglang_remote.py.
#![cfg(not(loom))]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::cluster::{cfg, serving, start_node, wait_view};
use common::Node;
use kvpool::weights::{chunk_key, Manifest};
use kvpool_client::weights::{PublishOptions, Weights};
use kvpool_client::{Client, SameHost};

const MODEL: &str = "org/two-node";

/// A safetensors file of `(name, dtype, shape)` tensors whose bytes are a counter per tensor.
fn safetensors(tensors: &[(&str, &str, &[u64], u64)]) -> (Vec<u8>, Vec<Vec<u8>>) {
    let (mut entries, mut datas, mut at) = (Vec::new(), Vec::new(), 0u64);
    for (i, (name, dtype, shape, elem)) in tensors.iter().enumerate() {
        let len = shape.iter().product::<u64>() * elem;
        let data: Vec<u8> = (0..len).map(|b| (b * 7 + i as u64) as u8).collect();
        entries.push(format!(
            r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{at},{}]}}"#,
            at + len
        ));
        at += len;
        datas.push(data);
    }
    let mut header = format!("{{{}}}", entries.join(",")).into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&header);
    datas.iter().for_each(|d| file.extend_from_slice(d));
    (file, datas)
}

fn connect(n: &Node) -> TcpStream {
    let s = TcpStream::connect(&n.resp).expect("connect to the RESP door");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

fn send(s: &mut TcpStream, args: &[&[u8]]) {
    let mut v = Vec::new();
    kvpool::resp::encode::command(&mut v, args);
    s.write_all(&v).unwrap();
}

fn line(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let mut b = [0u8; 1];
    while !out.ends_with(b"\r\n") {
        s.read_exact(&mut b).unwrap();
        out.push(b[0]);
    }
    out.truncate(out.len() - 2);
    String::from_utf8_lossy(&out).into_owned()
}

/// A bulk reply: Some(bytes), or None for a null.
fn bulk(s: &mut TcpStream) -> Option<Vec<u8>> {
    let l = line(s);
    assert!(l.starts_with('$'), "a bulk string, not {l:?}");
    let n: i64 = l[1..].parse().unwrap();
    if n < 0 {
        return None;
    }
    let mut v = vec![0u8; n as usize + 2];
    s.read_exact(&mut v).unwrap();
    v.truncate(n as usize);
    Some(v)
}

fn get(s: &mut TcpStream, key: &str) -> Option<Vec<u8>> {
    send(s, &[b"GET", key.as_bytes()]);
    bulk(s)
}

/// `SCAN 0 MATCH pattern`: (next cursor, keys).
fn scan(s: &mut TcpStream, pattern: &str) -> (String, Vec<String>) {
    send(s, &[b"SCAN", b"0", b"MATCH", pattern.as_bytes()]);
    assert_eq!(line(s), "*2");
    let cursor = String::from_utf8(bulk(s).unwrap()).unwrap();
    let n: usize = line(s)[1..].parse().unwrap();
    let keys = (0..n)
        .map(|_| String::from_utf8(bulk(s).unwrap()).unwrap())
        .collect();
    (cursor, keys)
}

/// The data of SGLang's value (`safetensors.torch.save({"tensor_bytes": t})`), checked to be
/// one tensor named `tensor_bytes` of `dtype` and `shape` covering the rest.
fn tensor_data(value: &[u8], dtype: &str, shape: &[u64]) -> Vec<u8> {
    let n = kvpool::weights::header_len(value[..8].try_into().unwrap()).unwrap() as usize;
    assert_eq!(n % 8, 0, "the header is padded to 8 bytes");
    let h = kvpool::weights::parse_header(&value[8..8 + n], value.len() as u64).unwrap();
    assert_eq!(h.tensors.len(), 1);
    let t = &h.tensors[0];
    assert_eq!(
        (t.name.as_str(), t.dtype.as_str(), t.shape.as_slice()),
        ("tensor_bytes", dtype, shape)
    );
    value[8 + n..].to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_reads_a_published_model_through_any_nodes_door() {
    let hb = ["--heartbeat-ms", "100", "--down-after-ms", "600"];
    let a = start_node(
        0,
        "64MiB",
        None,
        &[&["--resp", "127.0.0.1:0"][..], &hb].concat(),
    );
    let _b = start_node(1, "64MiB", Some(&a), &hb);
    let c = Client::connect(&a.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    wait_view(&c, "two serving", |v| serving(v) == 2).await;
    // The door refreshes its view when the membership's stamp moves; give it the same view.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let tensors: &[(&str, &str, &[u64], u64)] = &[
        ("embed.weight", "BF16", &[32, 64], 2),
        ("layers.0.weight", "F32", &[40, 64], 4),
        ("layers.0.bias", "I64", &[3], 8),
    ];
    let (file, datas) = safetensors(tensors);
    let dir = common::temp_dir("resp-weights");
    std::fs::write(dir.join("model.safetensors"), &file).unwrap();
    std::fs::write(dir.join("config.json"), b"{\"hidden_size\": 64}").unwrap();
    let w = Weights::new(&c, kvpool::weights::DEFAULT_NAMESPACE).unwrap();
    let opts = PublishOptions {
        chunk_size: 1024,
        ..PublishOptions::default()
    };
    let paths = [dir.join("model.safetensors"), dir.join("config.json")];
    let m: Manifest = w.publish(MODEL, &paths, &opts).await.unwrap();

    let mut s = connect(&a);
    let (cursor, mut keys) = scan(&mut s, &format!("{MODEL}/keys/rank_0/*"));
    keys.sort();
    assert_eq!(cursor, "0");
    assert_eq!(
        keys,
        [
            "org/two-node/keys/rank_0/embed.weight",
            "org/two-node/keys/rank_0/layers.0.bias",
            "org/two-node/keys/rank_0/layers.0.weight"
        ]
    );
    assert_eq!(
        scan(&mut s, &format!("{MODEL}/files/*")).1,
        ["org/two-node/files/config.json"]
    );
    assert_eq!(
        get(&mut s, &format!("{MODEL}/files/config.json")).unwrap(),
        b"{\"hidden_size\": 64}"
    );
    for ((name, dtype, shape, _), data) in tensors.iter().zip(&datas) {
        let v = get(&mut s, &format!("{MODEL}/keys/rank_0/{name}")).expect(name);
        assert_eq!(&tensor_data(&v, dtype, shape), data, "{name}");
    }

    // The chunks lie on both nodes; corrupt one that node 1 owns (its first copy only).
    let view = c.view().await.unwrap();
    let (fi, ti) = m.find("layers.0.weight", None).unwrap();
    let t = &m.files[fi].tensors[ti];
    let chunks: Vec<_> = m.tensor_chunks(fi, ti, t).collect();
    assert!(chunks.len() > 4, "the tensor is cut into chunks");
    let owners: Vec<_> = chunks
        .iter()
        .map(|ch| view.owner(&chunk_key(MODEL, ch)).unwrap().0)
        .collect();
    assert!(owners.contains(&0) && owners.contains(&1), "{owners:?}");
    let far = chunks[owners.iter().position(|&o| o == 1).unwrap()];
    let key = chunk_key(MODEL, &far);
    let wc = c.namespace(kvpool::weights::DEFAULT_NAMESPACE).unwrap();
    let good = wc.get(&key).await.unwrap().unwrap();
    let bad: Vec<u8> = good.iter().map(|b| b ^ 0x40).collect();
    wc.put(&key, &bad).await.unwrap();
    let tensor = format!("{MODEL}/keys/rank_0/layers.0.weight");
    assert_eq!(
        get(&mut s, &tensor),
        None,
        "a chunk failing its checksum: a miss"
    );
    // The other tensors are still served; restoring the chunk serves this one again.
    assert!(get(&mut s, &format!("{MODEL}/keys/rank_0/embed.weight")).is_some());
    wc.put(&key, &good).await.unwrap();
    let v = get(&mut s, &tensor).unwrap();
    assert_eq!(tensor_data(&v, "F32", &[40, 64]), datas[1]);
    // After the model is removed the names are ordinary (missing) keys again.
    w.remove(MODEL).await.unwrap();
    assert_eq!(get(&mut s, &tensor), None);
    assert_eq!(
        scan(&mut s, &format!("{MODEL}/keys/rank_0/*")).1,
        Vec::<String>::new()
    );
}
