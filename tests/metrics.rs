//! The metrics page of a real `kvpoold`, parsed: every line is a well-formed OpenMetrics
//! descriptor or sample, label values are escaped (a namespace name with a quote, a backslash
//! and a newline comes back intact), and every metric docs/OPERATIONS.md documents is there.
#![cfg(not(loom))]

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::Node;
use kvpool_client::{Client, ClientConfig, SameHost};

/// One sample: its name, labels and value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// The page: families by name (with their type) and the samples, in order.
#[derive(Debug, Default)]
struct Page {
    families: BTreeMap<String, String>,
    samples: Vec<Sample>,
}

fn metric_name(s: &str) -> Result<(&str, &str), String> {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(s.len());
    let name = &s[..end];
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return Err(format!("bad metric name in {s:?}"));
    }
    Ok((name, &s[end..]))
}

/// Parses `{a="x",b="y"}` at the start of `s`, unescaping the values; returns the rest.
fn labels(mut s: &str) -> Result<(BTreeMap<String, String>, &str), String> {
    let mut out = BTreeMap::new();
    let Some(rest) = s.strip_prefix('{') else {
        return Ok((out, s));
    };
    s = rest;
    loop {
        if let Some(rest) = s.strip_prefix('}') {
            return Ok((out, rest));
        }
        let (name, rest) = metric_name(s)?;
        let rest = rest
            .strip_prefix("=\"")
            .ok_or_else(|| format!("label {name} has no quoted value: {s:?}"))?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err(format!("unterminated label value: {rest:?}")),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, 'n')) => value.push('\n'),
                    other => return Err(format!("bad escape {other:?} in {rest:?}")),
                },
                Some((_, c)) => value.push(c),
            }
        };
        if out.insert(name.to_string(), value).is_some() {
            return Err(format!("label {name} repeated"));
        }
        s = &rest[end + 1..];
        if let Some(rest) = s.strip_prefix(',') {
            s = rest;
        } else if !s.starts_with('}') {
            return Err(format!("expected , or }} at {s:?}"));
        }
    }
}

/// Parses an OpenMetrics text page strictly enough to catch what a scraper would reject.
fn parse(body: &str) -> Result<Page, String> {
    let mut page = Page::default();
    let body = body
        .strip_suffix("# EOF\n")
        .ok_or("the page does not end in # EOF")?;
    let mut family: Option<(String, String)> = None;
    for line in body.lines() {
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let (kind, name) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let arg = parts.next().ok_or(format!("bad comment line {line:?}"))?;
            metric_name(name).and_then(|(n, r)| {
                (n == name && r.is_empty())
                    .then_some(())
                    .ok_or(format!("bad name {name:?}"))
            })?;
            match kind {
                "HELP" => {}
                "UNIT" => {
                    if !name.ends_with(&format!("_{arg}")) {
                        return Err(format!("{name} does not end in its unit {arg}"));
                    }
                }
                "TYPE" => {
                    if !["counter", "gauge", "histogram"].contains(&arg) {
                        return Err(format!("unexpected type {arg} of {name}"));
                    }
                    if page.families.insert(name.into(), arg.into()).is_some() {
                        return Err(format!("family {name} described twice"));
                    }
                    family = Some((name.into(), arg.into()));
                }
                _ => return Err(format!("unexpected comment {line:?}")),
            }
            continue;
        }
        let (name, rest) = metric_name(line)?;
        let (labels, rest) = labels(rest)?;
        let value = rest
            .strip_prefix(' ')
            .ok_or(format!("no value in {line:?}"))?;
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().map_err(|_| format!("bad value in {line:?}"))?,
        };
        let (fam, kind) = family
            .as_ref()
            .ok_or(format!("sample before any TYPE: {line:?}"))?;
        let suffixes: &[&str] = match kind.as_str() {
            "counter" => &["_total"],
            "gauge" => &[""],
            _ => &["_bucket", "_sum", "_count"],
        };
        if !suffixes.iter().any(|s| name == format!("{fam}{s}")) {
            return Err(format!("sample {name} is not of family {fam} ({kind})"));
        }
        if name.ends_with("_bucket") && !labels.contains_key("le") {
            return Err(format!("bucket without le: {line:?}"));
        }
        page.samples.push(Sample {
            name: name.into(),
            labels,
            value,
        });
    }
    Ok(page)
}

/// The metric names in the Metrics table of docs/OPERATIONS.md.
fn documented() -> BTreeSet<String> {
    let docs = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/OPERATIONS.md"
    ))
    .unwrap();
    let table = docs
        .split("\n## Metrics\n")
        .nth(1)
        .expect("a Metrics section")
        .split("\n\n")
        .find(|p| p.starts_with("| metric |"))
        .expect("a table of metrics");
    table
        .lines()
        .skip(2)
        .filter_map(|row| row.split('|').nth(1))
        .flat_map(|cell| cell.split('`').skip(1).step_by(2).map(str::to_string))
        .collect()
}

fn get(page: &Page, name: &str, want: &[(&str, &str)]) -> f64 {
    page.samples
        .iter()
        .find(|s| {
            s.name == name
                && want
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .unwrap_or_else(|| panic!("no {name} {want:?}"))
        .value
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_parses_and_escapes_label_values() {
    let weird = "we\"ird\\ns\nline";
    let cfg = common::temp_dir("metrics-config").join("kvpoold.toml");
    std::fs::write(
        &cfg,
        "[listen]\nmetrics_namespaces = \"open\"\n\
         [[namespace]]\nname = \"we\\\"ird\\\\ns\\nline\"\nquota = \"4MiB\"\n",
    )
    .unwrap();
    let n = Node::start("16MiB", &["-c", cfg.to_str().unwrap()]);
    let c = Client::connect(
        &n.tcp_url(),
        ClientConfig {
            namespace: weird.into(),
            same_host: SameHost::Off,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    c.put(b"k", b"value").await.unwrap();
    assert_eq!(c.get(b"k").await.unwrap().unwrap(), b"value");

    let response = n.scrape();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.contains("Content-Type: application/openmetrics-text; version=1.0.0"),
        "{head}"
    );
    let page = parse(body).unwrap_or_else(|e| panic!("{e}\n{body}"));

    // The namespace name comes back exactly, in every per-namespace series.
    let ns = [("namespace", weird)];
    assert_eq!(get(&page, "kvpool_namespace_objects", &ns), 1.0);
    assert_eq!(
        get(&page, "kvpool_namespace_bytes", &[ns[0], ("kind", "quota")]),
        (4 << 20) as f64
    );
    assert!(get(&page, "kvpool_namespace_bytes", &[ns[0], ("kind", "used")]) >= 5.0);
    assert_eq!(
        get(
            &page,
            "kvpool_operations_total",
            &[("op", "put"), ("outcome", "ok")]
        ),
        1.0
    );
    assert_eq!(get(&page, "kvpool_hits_total", &[("node", "0")]), 1.0);
    assert_eq!(
        get(&page, "kvpool_operation_seconds_count", &[("op", "put")]),
        1.0
    );
    assert_eq!(
        get(
            &page,
            "kvpool_operation_seconds_bucket",
            &[("op", "put"), ("le", "+Inf")]
        ),
        1.0
    );
    assert!(get(&page, "kvpool_connections", &[("transport", "tcp")]) >= 1.0);
    // The put's block was the first in its 2 MiB region: the region was tried for huge pages
    // (collapsed where the kernel can, docs/ARCHITECTURE.md), and counted either way.
    let seg = [("node", "0"), ("segment", "0")];
    let tried: f64 = ["collapsed", "refused"]
        .iter()
        .map(|s| {
            get(
                &page,
                "kvpool_segment_huge_regions",
                &[seg[0], seg[1], ("state", s)],
            )
        })
        .sum();
    assert!(tried >= 1.0, "no region tried: {tried}");
    // The prefaulting thread faults in the region after it, as far ahead as the put reached
    // (docs/OPERATIONS.md, `[memory] prefault_ahead`); it works in the background.
    let prefaulted = |page: &Page| get(page, "kvpool_segment_prefaulted_bytes_total", &seg);
    let mut page = page;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while prefaulted(&page) < (2 << 20) as f64 && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let response = n.scrape();
        page = parse(response.split_once("\r\n\r\n").unwrap().1).unwrap();
    }
    assert_eq!(
        prefaulted(&page),
        (2 << 20) as f64,
        "one region ahead of one"
    );
    // The node's segments are files: its index journal is written, and holds the put's commit.
    let node = [("node", "0")];
    assert_eq!(get(&page, "kvpool_journal_healthy", &node), 1.0);
    assert!(get(&page, "kvpool_journal_records", &node) >= 1.0);
    assert!(
        get(&page, "kvpool_journal_bytes", &node) > 54.0,
        "more than its header"
    );
    assert_eq!(
        get(&page, "kvpool_journal_compaction_failures_total", &node),
        0.0
    );

    // Every documented metric is on the page, and every family on it is documented.
    let names: BTreeSet<&str> = page.samples.iter().map(|s| s.name.as_str()).collect();
    let docs = documented();
    for d in &docs {
        let histogram = format!("{d}_bucket");
        assert!(
            names.contains(d.as_str()) || names.contains(histogram.as_str()),
            "documented {d} is not on the page"
        );
    }
    for (family, kind) in &page.families {
        let sample = if kind == "counter" {
            format!("{family}_total")
        } else {
            family.clone()
        };
        assert!(docs.contains(&sample), "{sample} is not in the docs table");
    }
}

/// The handoff keys given up are counted by how: failed by their producer, cancelled, or left
/// to a lease that lapsed; and a lone node's view holds one serving node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_failures_are_counted_by_cause() {
    let n = Node::start("16MiB", &[]);
    let cfg = ClientConfig {
        same_host: SameHost::Off,
        ..Default::default()
    };
    let c = Client::connect(&n.tcp_url(), cfg).await.unwrap();
    let page = || {
        let response = n.scrape();
        let body = response.split_once("\r\n\r\n").unwrap().1.to_string();
        parse(&body).unwrap_or_else(|e| panic!("{e}\n{body}"))
    };
    let failures =
        |p: &Page, cause: &str| get(p, "kvpool_handoff_failures_total", &[("cause", cause)]);
    let before = page();
    for cause in ["failed", "cancelled", "lapsed"] {
        assert_eq!(failures(&before, cause), 0.0, "{cause}");
    }
    assert_eq!(
        get(&before, "kvpool_cluster_nodes", &[("state", "serving")]),
        1.0
    );
    assert_eq!(
        get(&before, "kvpool_cluster_nodes", &[("state", "down")]),
        0.0
    );

    c.fail(&[b"f1", b"f2", b"f3"], "prefill failed")
        .await
        .unwrap();
    c.put(b"c1", b"block").await.unwrap();
    c.cancel(&[b"c1", b"c2"], "aborted").await.unwrap();
    // A lease that is never renewed lapses (the reaper looks ten times a second).
    c.put(b"l1", b"block").await.unwrap();
    c.expire(&[b"l1"], std::time::Duration::from_millis(50))
        .await
        .unwrap();
    let mut lapsed = 0.0;
    for _ in 0..100 {
        lapsed = failures(&page(), "lapsed");
        if lapsed > 0.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(lapsed, 1.0, "the lease's key lapsed once");
    assert_eq!(c.get(b"l1").await.unwrap(), None, "and its object is gone");
    let after = page();
    assert_eq!(failures(&after, "failed"), 3.0);
    assert_eq!(failures(&after, "cancelled"), 2.0);
    // A renewed lease ended with a ttl of 0 is not a failure.
    c.put(b"r1", b"block").await.unwrap();
    c.expire(&[b"r1"], std::time::Duration::from_secs(60))
        .await
        .unwrap();
    c.expire(&[b"r1"], std::time::Duration::ZERO).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(failures(&page(), "lapsed"), 1.0);
}

/// `kvpool_cluster_nodes` follows the view: two serving nodes, then one serving and one down
/// once the other is killed.
#[test]
fn the_cluster_view_is_counted_by_state() {
    let timing = ["--heartbeat-ms", "100", "--down-after-ms", "600"];
    let n0 = common::cluster::start_node(0, "16MiB", None, &timing);
    let mut n1 = common::cluster::start_node(1, "16MiB", Some(&n0), &timing);
    let nodes = |state: &str| {
        let response = n0.scrape();
        let body = response.split_once("\r\n\r\n").unwrap().1.to_string();
        let page = parse(&body).unwrap_or_else(|e| panic!("{e}\n{body}"));
        get(&page, "kvpool_cluster_nodes", &[("state", state)])
    };
    let until = |want: [(&str, f64); 2]| {
        let t = std::time::Instant::now();
        while want.iter().any(|&(s, n)| nodes(s) != n) {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(20),
                "never {want:?}: serving {}, down {}",
                nodes("serving"),
                nodes("down")
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    until([("serving", 2.0), ("down", 0.0)]);
    n1.kill();
    until([("serving", 1.0), ("down", 1.0)]);
    assert_eq!(nodes("joining") + nodes("draining"), 0.0);
}
