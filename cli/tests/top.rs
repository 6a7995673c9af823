//! `kvpool top` against a real cluster of `kvpoold` processes on loopback: every node reported,
//! the counts it shows equal to the load the test drove, a killed node shown down.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvpool_client::blocking::Client;
use kvpool_client::{ClientConfig, SameHost};
use kvpool_system_tests::{value, Node};
use serde_json::Value;

/// Fast heartbeats: a killed node leaves the view within a second.
const HEARTBEAT: [&str; 4] = ["--heartbeat-ms", "100", "--down-after-ms", "600"];

/// Bytes of the disk tier `cluster` gives node 1 when asked to.
const DISK: u64 = 64 << 20;

/// `n` nodes (ids 0..n) joined through node 0, node 1 with a disk tier in `disk` when given,
/// and a TCP client of node 0 once all serve.
fn cluster(n: u32, disk: Option<&Path>) -> (Vec<Node>, Client) {
    let seed = Node::start("32MiB", &[&["--node-id", "0"][..], &HEARTBEAT].concat());
    let mut nodes = vec![seed];
    for id in 1..n {
        let secret = nodes[0].secret_file().to_str().unwrap().to_string();
        let (tag, peer) = (id.to_string(), nodes[0].tcp.clone());
        let path = disk.map_or("", |d| d.to_str().unwrap());
        let capacity = DISK.to_string();
        let disk_args = [
            "--disk-path",
            path,
            "--disk-capacity",
            &capacity,
            "--disk-region-size",
            "4MiB",
        ];
        let cluster_args = [
            "--node-id",
            &tag,
            "--peer",
            &peer,
            "--cluster-secret-file",
            &secret,
        ];
        let with_disk: &[&str] = if disk.is_some() && id == 1 {
            &disk_args
        } else {
            &[]
        };
        let args = [&cluster_args[..], &HEARTBEAT, with_disk].concat();
        nodes.push(Node::start("32MiB", &args));
    }
    // A miss asks the key's owner only (not, for a while after the view changed, its previous
    // owner too), so that each of the test's gets is one operation on one node.
    let cfg = ClientConfig {
        same_host: SameHost::Off,
        timeout: Duration::from_secs(5),
        fallback_window: Duration::ZERO,
        ..ClientConfig::default()
    };
    let client = Client::connect(&nodes[0].tcp_url(), cfg).unwrap();
    let t = Instant::now();
    loop {
        let v = client.view().unwrap();
        let serving = v.nodes.iter().filter(|n| n.state.name() == "serving");
        if serving.count() == n as usize {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "never {n} serving");
        std::thread::sleep(Duration::from_millis(50));
    }
    (nodes, client)
}

/// `kvpool top --once --json` through `node`: its one frame.
fn top_once(node: &Node) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_kvpool"))
        .args(["--endpoint", &node.tcp_url(), "--no-local"])
        .args(["top", "--once", "--json", "--interval", "0.3"])
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "--once prints one frame: {stdout}");
    serde_json::from_str(lines[0]).unwrap()
}

fn node_row(frame: &Value, id: u64) -> &Value {
    frame["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == id)
        .unwrap_or_else(|| panic!("node {id} not in {frame}"))
}

/// Every count of a frame agrees with its rate over the frame's interval.
fn check_rates(row: &Value) {
    let (counts, rates) = (&row["counts"], &row["per_second"]);
    let secs = row["interval_s"].as_f64().unwrap();
    assert!(secs > 0.0, "{row}");
    for k in [
        "evictions",
        "ops_in",
        "ops_out",
        "bytes_in",
        "bytes_out",
        "refusals",
    ] {
        let (c, r) = (counts[k].as_u64().unwrap(), rates[k].as_f64().unwrap());
        assert!(
            (c as f64 - r * secs).abs() < 1e-6 * (1.0 + c as f64),
            "{k}: {row}"
        );
    }
}

#[test]
fn top_once_reports_every_node_and_a_killed_one_as_down() {
    let disk = kvpool_system_tests::temp_dir("top-disk");
    let (mut nodes, client) = cluster(3, Some(&disk));
    for i in 0..60u64 {
        client
            .put(format!("k{i}").as_bytes(), &value(i, 1000))
            .unwrap();
    }
    let f = top_once(&nodes[0]);
    assert_eq!(f["nodes"].as_array().unwrap().len(), 3, "{f}");
    let mut objects = 0;
    for id in 0..3 {
        let n = node_row(&f, id);
        assert_eq!(n["state"], "serving", "{n}");
        assert!(n["error"].is_null(), "{n}");
        assert_eq!(n["tcp"], nodes[id as usize].tcp, "{n}");
        assert!(n["capacity"].as_u64().unwrap() >= 32 << 20, "{n}");
        assert!(
            n["used_bytes"].as_u64().unwrap() > 0,
            "every node holds some of 60 keys: {n}"
        );
        objects += n["objects"].as_u64().unwrap();
        check_rates(n);
        match id {
            1 => assert_eq!(n["disk"]["capacity"], DISK, "node 1's disk tier: {n}"),
            _ => assert!(n["disk"].is_null(), "no disk tier: {n}"),
        }
    }
    assert_eq!(objects, 60, "{f}");
    let t = &f["totals"];
    assert_eq!((t["nodes"].as_u64(), t["up"].as_u64()), (Some(3), Some(3)));
    assert_eq!(t["objects"], 60);
    assert_eq!(t["disk"]["capacity"], DISK, "{t}");

    nodes[2].kill();
    let f = top_once(&nodes[0]);
    let down = node_row(&f, 2);
    assert_eq!(down["state"], "down", "{down}");
    assert!(
        down["used_bytes"].is_null() && down["counts"].is_null(),
        "{down}"
    );
    for id in 0..2 {
        assert_eq!(node_row(&f, id)["state"], "serving", "{f}");
    }
    assert_eq!(f["totals"]["up"], 2, "{f}");
    drop(nodes);
    let _ = std::fs::remove_dir_all(&disk);
}

#[test]
fn top_counts_match_the_load_driven() {
    let (nodes, client) = cluster(2, None);
    let mut top = Command::new(env!("CARGO_BIN_EXE_kvpool"))
        .args(["--endpoint", &nodes[0].tcp_url(), "--no-local"])
        .args(["top", "--json", "--interval", "0.2", "--count", "100"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, frames) = mpsc::channel();
    let stdout = top.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let frame: Value = serde_json::from_str(&line.unwrap()).unwrap();
            if tx.send(frame).is_err() {
                return;
            }
        }
    });
    let next = || {
        frames
            .recv_timeout(Duration::from_secs(10))
            .expect("a frame")
    };
    // The first frame is printed after its second poll: what follows is counted by later ones.
    next();
    let (puts, misses, len) = (40u64, 10u64, 500usize);
    for i in 0..puts {
        client
            .put(format!("k{i}").as_bytes(), &value(i, len))
            .unwrap();
    }
    for i in 0..puts {
        let v = client.get(format!("k{i}").as_bytes()).unwrap();
        assert_eq!(v, Some(value(i, len)));
    }
    for i in 0..misses {
        assert_eq!(client.get(format!("absent{i}").as_bytes()).unwrap(), None);
    }
    let want = [
        puts,
        puts + misses,
        puts,
        misses,
        puts * len as u64,
        puts * len as u64,
    ];
    let keys = [
        "ops_in",
        "ops_out",
        "hits",
        "misses",
        "bytes_in",
        "bytes_out",
    ];
    let mut sum = [0u64; 6];
    let mut per_node = [[0u64; 6]; 2];
    let mut seen = 0;
    while sum != want {
        assert!(seen < 50, "counts {sum:?} never reached {want:?}");
        let f = next();
        seen += 1;
        for (i, k) in keys.iter().enumerate() {
            sum[i] += f["totals"]["counts"][k].as_u64().unwrap();
            for (id, node) in per_node.iter_mut().enumerate() {
                let row = node_row(&f, id as u64);
                check_rates(row);
                node[i] += row["counts"][k].as_u64().unwrap();
            }
        }
        for (s, w) in sum.iter().zip(want) {
            assert!(*s <= w, "counts {sum:?} went past the load {want:?}");
        }
    }
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(
            per_node[0][i] + per_node[1][i],
            want[i],
            "{k}: nodes sum to the total"
        );
    }
    assert!(
        per_node.iter().all(|n| n[0] > 0),
        "both nodes took puts: {per_node:?}"
    );
    top.kill().unwrap();
    top.wait().unwrap();
}
