//! deploy/monitoring/: the Prometheus rules pass `promtool check rules` and their unit tests
//! (`promtool test rules`), which make every alert fire and stay silent; each alert carries what
//! an operator needs (a duration, a severity, a summary, a description, a runbook section that
//! exists in docs/OPERATIONS.md); the Grafana dashboard is well formed; and Debian's Prometheus
//! server, scraping a real 3-node cluster under load, loads the rules without error and answers
//! every panel's query with data.
#![cfg(not(loom))]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::cluster::{cfg, key, start_node, wait_view};
use common::Node;
use kvpool_client::{Client, SameHost};
use serde_json::Value;

fn monitoring() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/monitoring")
}

fn rules_file() -> PathBuf {
    monitoring().join("kvpool-alerts.yaml")
}

fn dashboard() -> Value {
    let path = monitoring().join("kvpool-dashboard.json");
    let text = std::fs::read_to_string(&path).unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Whether `tool` runs (`tool --version`).
fn installed(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The value of `key: value` on a YAML line, unquoted.
fn yaml_value<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let rest = line.trim_start().trim_start_matches("- ");
    let v = rest.strip_prefix(key)?.strip_prefix(':')?.trim();
    Some(v.trim_matches('"'))
}

/// The alerts of the rules file, each with the keys its block sets (`for`, `severity`, ...) and
/// its runbook link.
fn alerts() -> BTreeMap<String, (BTreeSet<String>, String)> {
    let text = std::fs::read_to_string(rules_file()).unwrap();
    let mut out: BTreeMap<String, (BTreeSet<String>, String)> = BTreeMap::new();
    let mut current = None;
    for line in text.lines() {
        if let Some(name) = yaml_value(line, "alert") {
            current = Some(name.to_string());
            out.insert(name.to_string(), Default::default());
            continue;
        }
        if yaml_value(line, "record").is_some() {
            current = None;
        }
        let Some(name) = &current else { continue };
        let entry = out.get_mut(name).unwrap();
        for key in ["for", "severity", "summary", "description", "runbook_url"] {
            if let Some(v) = yaml_value(line, key) {
                entry.0.insert(key.to_string());
                if key == "runbook_url" {
                    entry.1 = v.to_string();
                }
            }
        }
    }
    out
}

/// GitHub's anchor of a Markdown heading.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

#[test]
fn promtool_checks_the_rules_and_their_unit_tests_pass() {
    let test = "promtool_checks_the_rules_and_their_unit_tests_pass";
    if !common::deps::require(
        installed("promtool"),
        test,
        "promtool",
        "apt-get install prometheus",
    ) {
        return;
    }
    let check = Command::new("promtool")
        .arg("check")
        .arg("rules")
        .arg(rules_file())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&check.stdout).to_string()
        + &String::from_utf8_lossy(&check.stderr);
    assert!(check.status.success(), "promtool check rules: {said}");

    let tests: Vec<PathBuf> = std::fs::read_dir(monitoring().join("tests"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    assert!(!tests.is_empty(), "no unit tests of the rules");
    let run = Command::new("promtool")
        .arg("test")
        .arg("rules")
        .args(&tests)
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&run.stdout).to_string() + &String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "promtool test rules: {said}");

    // Every alert is tested firing (a non-empty `exp_alerts`) and silent (an empty one).
    let (mut firing, mut silent) = (BTreeSet::new(), BTreeSet::new());
    for t in &tests {
        let text = std::fs::read_to_string(t).unwrap();
        let mut name = String::new();
        for line in text.lines() {
            if let Some(n) = yaml_value(line, "alertname") {
                name = n.to_string();
            } else if let Some(v) = yaml_value(line, "exp_alerts") {
                if v == "[]" {
                    silent.insert(name.clone());
                } else {
                    firing.insert(name.clone());
                }
            }
        }
    }
    let alerts = alerts();
    assert!(alerts.len() >= 10, "{alerts:?}");
    for name in alerts.keys() {
        assert!(firing.contains(name), "{name} is never tested firing");
        assert!(silent.contains(name), "{name} is never tested silent");
    }
}

#[test]
fn every_alert_says_how_long_how_bad_what_and_where_its_runbook_is() {
    let ops = std::fs::read_to_string(monitoring().join("../../docs/OPERATIONS.md")).unwrap();
    let anchors: BTreeSet<String> = ops
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|h| anchor(h.trim_start_matches('#')))
        .collect();
    let alerts = alerts();
    assert!(!alerts.is_empty());
    for (name, (keys, runbook)) in &alerts {
        for key in ["for", "severity", "summary", "description", "runbook_url"] {
            assert!(keys.contains(key), "{name} has no {key}");
        }
        let target = runbook
            .strip_prefix("docs/OPERATIONS.md#")
            .unwrap_or_else(|| panic!("{name}'s runbook {runbook} is not in docs/OPERATIONS.md"));
        assert!(
            anchors.contains(target),
            "{name}'s runbook #{target} is no heading of docs/OPERATIONS.md"
        );
    }
}

/// The dashboard's panels that show data (rows aside).
fn panels(d: &Value) -> Vec<&Value> {
    d["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .filter(|p| p["type"] != "row")
        .collect()
}

#[test]
fn the_dashboard_is_well_formed() {
    let d = dashboard();
    assert_eq!(d["uid"], "kvpool");
    let vars: BTreeMap<&str, &Value> = d["templating"]["list"]
        .as_array()
        .expect("variables")
        .iter()
        .map(|v| (v["name"].as_str().unwrap(), v))
        .collect();
    assert_eq!(vars["datasource"]["type"], "datasource");
    assert_eq!(vars["datasource"]["query"], "prometheus");
    assert_eq!(vars["instance"]["type"], "query");
    assert_eq!(vars["instance"]["allValue"], ".*");

    let mut ids = BTreeSet::new();
    let mut cells = BTreeSet::new();
    for p in d["panels"].as_array().unwrap() {
        let title = p["title"].as_str().expect("a title");
        assert!(
            ids.insert(p["id"].as_u64().expect("an id")),
            "id of {title}"
        );
        let g = &p["gridPos"];
        let [x, y, w, h] = ["x", "y", "w", "h"].map(|k| g[k].as_u64().expect("gridPos"));
        assert!(w > 0 && h > 0 && x + w <= 24, "{title}: {g}");
        // No two panels overlap.
        for cx in x..x + w {
            for cy in y..y + h {
                assert!(cells.insert((cx, cy)), "{title} overlaps another panel");
            }
        }
    }
    let shown = panels(&d);
    assert!(shown.len() >= 15, "{} panels", shown.len());
    for p in shown {
        let title = p["title"].as_str().unwrap();
        assert_eq!(p["datasource"]["type"], "prometheus", "{title}");
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{title}");
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title} has no query");
        let mut refs = BTreeSet::new();
        for t in targets {
            assert!(
                t["expr"]
                    .as_str()
                    .is_some_and(|e| e.contains("kvpool") || e.contains("up{")),
                "{title}: {t}"
            );
            assert!(refs.insert(t["refId"].as_str().expect("refId")), "{title}");
        }
    }
}

/// A free loopback port (bound, then released).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Percent-encodes a query-string value.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `GET path` from the Prometheus at `addr`: the status code and the body.
fn http_get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, body.to_string()))
}

/// The `data` of a successful answer of Prometheus's HTTP API.
fn api(addr: &str, path: &str) -> Value {
    let (code, body) = http_get(addr, path).unwrap();
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"));
    assert!(code == 200 && v["status"] == "success", "{path}: {body}");
    v["data"].clone()
}

/// A Prometheus server, killed when dropped (and by `timeout` at the latest).
struct Prometheus {
    child: Child,
    addr: String,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        // SIGTERM to `timeout`, which passes it on to Prometheus and exits with it (a SIGKILL
        // would leave Prometheus running without its parent).
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
    }
}

/// Starts Prometheus on a free loopback port scraping `targets` every second, with the rules.
fn start_prometheus(targets: &[String]) -> Prometheus {
    let dir = common::temp_dir("prometheus");
    let list = targets
        .iter()
        .map(|t| format!("'{t}'"))
        .collect::<Vec<_>>()
        .join(", ");
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
         rule_files:\n  - '{}'\n\
         scrape_configs:\n  - job_name: kvpool\n    static_configs:\n      - targets: [{list}]\n",
        rules_file().canonicalize().unwrap().display()
    );
    let config_file = dir.join("prometheus.yml");
    std::fs::write(&config_file, config).unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    // Bounded: `timeout` ends it even if this test process dies without dropping it.
    let child = Command::new("timeout")
        .args(["-s", "KILL", "300", "prometheus"])
        .arg(format!("--config.file={}", config_file.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={addr}"))
        .arg("--log.level=warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
        .spawn()
        .expect("starting prometheus");
    let p = Prometheus { child, addr };
    let t = Instant::now();
    while !matches!(http_get(&p.addr, "/-/ready"), Ok((200, _))) {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "prometheus never ready"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    p
}

/// A panel's query as Grafana sends it with every node picked and a 1 s scrape interval.
fn substitute(expr: &str) -> String {
    expr.replace("$__rate_interval", "20s")
        .replace("${instance}", ".*")
        .replace("$instance", ".*")
}

/// Load on the cluster: 8 MiB of puts a round (the three nodes hold 12 MiB, so they evict to
/// their disk tiers), gets of what is there and of what is not, and handoff keys a producer gives
/// up.
async fn load(c: &Client, round: u64) {
    let v = vec![round as u8; 16 << 10];
    let keys: Vec<Vec<u8>> = (0..512).map(|i| key(round * 1000 + i)).collect();
    for chunk in keys.chunks(64) {
        let items: Vec<(&[u8], &[u8])> = chunk.iter().map(|k| (&k[..], &v[..])).collect();
        c.batch_put_from(&items).await.unwrap();
    }
    for i in 0..100 {
        c.get(&keys[keys.len() - 1 - i]).await.unwrap();
        c.get(&key(1_000_000 + i as u64)).await.unwrap();
    }
    let failed: Vec<Vec<u8>> = (0..10).map(|i| key(2_000_000 + round * 10 + i)).collect();
    let failed: Vec<&[u8]> = failed.iter().map(|k| &k[..]).collect();
    c.fail(&failed, "prefill failed").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_a_three_node_cluster_and_every_panel_has_data() {
    let test = "prometheus_scrapes_a_three_node_cluster_and_every_panel_has_data";
    if !common::deps::require(
        installed("prometheus"),
        test,
        "prometheus",
        "apt-get install prometheus",
    ) {
        return;
    }
    let dir = common::temp_dir("monitoring");
    let conf = dir.join("kvpoold.toml");
    std::fs::write(&conf, "[listen]\nmetrics_namespaces = \"open\"\n").unwrap();
    let node_args = |id: u32| {
        let disk = dir.join(format!("disk-{id}"));
        [
            "-c".to_string(),
            conf.display().to_string(),
            "--disk-path".into(),
            disk.display().to_string(),
            "--disk-capacity".into(),
            "16MiB".into(),
            "--disk-region-size".into(),
            "1MiB".into(),
            "--disk-admit".into(),
            "all".into(),
        ]
    };
    let a0 = node_args(0);
    let n0 = start_node(
        0,
        "4MiB",
        None,
        &a0.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let (a1, a2) = (node_args(1), node_args(2));
    let n1 = start_node(
        1,
        "4MiB",
        Some(&n0),
        &a1.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let n2 = start_node(
        2,
        "4MiB",
        Some(&n0),
        &a2.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let nodes: [&Node; 3] = [&n0, &n1, &n2];
    let c = Client::connect(&n0.tcp_url(), cfg(SameHost::Off))
        .await
        .unwrap();
    wait_view(&c, "three serving nodes", |v| {
        common::cluster::serving(v) == 3
    })
    .await;

    let targets: Vec<String> = nodes.iter().map(|n| n.metrics.clone()).collect();
    let prom = start_prometheus(&targets);
    let t = Instant::now();
    // Load for a few scrapes, so that every rate over the panels' window is measured, and
    // twice what the nodes hold at least, so that they evict.
    let mut round = 0;
    while round < 3 || t.elapsed() < Duration::from_secs(6) {
        load(&c, round).await;
        round += 1;
    }
    // Two more scrapes after the load, then every query at one instant.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();

    let up = api(&prom.addr, "/api/v1/targets");
    let active = up["activeTargets"].as_array().unwrap();
    assert_eq!(active.len(), 3, "{up}");
    for target in active {
        assert_eq!(target["health"], "up", "{target}");
    }

    // The rules: loaded, every one evaluated without error.
    let rules_in_file = std::fs::read_to_string(rules_file())
        .unwrap()
        .lines()
        .filter(|l| yaml_value(l, "alert").is_some() || yaml_value(l, "record").is_some())
        .count();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let groups = api(&prom.addr, "/api/v1/rules");
        let rules: Vec<&Value> = groups["groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_array().unwrap())
            .collect();
        assert_eq!(rules.len(), rules_in_file, "{groups}");
        for r in &rules {
            assert!(
                r["lastError"].as_str().unwrap_or("").is_empty() && r["health"] != "err",
                "{r}"
            );
        }
        if rules.iter().all(|r| r["health"] == "ok") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "rules never all evaluated: {groups}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // Every panel's every query has data; those the load drives have some above zero.
    let driven = [
        "Nodes up",
        "Hit rate",
        "Operations per second",
        "Payload bytes per second",
        "Evictions per second",
        "Demotions and promotions per second",
        "Handoff keys given up per second",
        "Memory use per node",
        "Memory use per namespace",
        "Open connections",
        "Index journal healthy",
    ];
    let d = dashboard();
    let mut empty = Vec::new();
    let mut flat = Vec::new();
    for p in panels(&d) {
        let title = p["title"].as_str().unwrap();
        let mut max = 0.0_f64;
        for target in p["targets"].as_array().unwrap() {
            let expr = substitute(target["expr"].as_str().unwrap());
            let path = format!("/api/v1/query?query={}&time={at:.3}", encode(&expr));
            let data = api(&prom.addr, &path);
            let result = data["result"].as_array().unwrap();
            if result.is_empty() {
                empty.push(format!("{title}: {expr}"));
            }
            for s in result {
                let v: f64 = s["value"][1].as_str().unwrap().parse().unwrap_or(f64::NAN);
                if v.is_finite() {
                    max = max.max(v);
                }
            }
        }
        if driven.contains(&title) && max <= 0.0 {
            flat.push(title.to_string());
        }
    }
    assert!(
        empty.is_empty(),
        "queries without data:\n{}",
        empty.join("\n")
    );
    assert!(
        flat.is_empty(),
        "panels the load drives show no activity: {flat:?}"
    );
    // The latency quantiles of the load's operations are measured values, not NaN.
    let p99 = "histogram_quantile(0.99, sum by (le) (rate(kvpool_operation_seconds_bucket{op=\"get\"}[20s])))";
    let data = api(
        &prom.addr,
        &format!("/api/v1/query?query={}&time={at:.3}", encode(p99)),
    );
    let v: f64 = data["result"][0]["value"][1]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(v > 0.0 && v.is_finite(), "get p99 {v}");
    drop(prom);
}
