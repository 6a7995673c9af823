//! The `kvpool` command line against a real `kvpoold`.

use std::io::Write;
use std::process::{Command, Stdio};

use kvpool_system_tests::{temp_dir, Node};

fn start() -> (Node, String) {
    start_with(&[])
}

/// A node with TCP only (no QUIC, no metrics), started with `extra` arguments, and its endpoint.
fn start_with(extra: &[&str]) -> (Node, String) {
    let node = Node::start_in(temp_dir("cli"), "32MiB", extra, &["127.0.0.1:0", "", ""]);
    let ep = node.tcp_url();
    (node, ep)
}

fn kvpool(endpoint: &str, args: &[&str], stdin: &[u8]) -> (i32, Vec<u8>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvpool"))
        .args(["--endpoint", endpoint])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap(),
        out.stdout,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn put_get_exists_rm_stats() {
    let (_d, ep) = start();
    let value: Vec<u8> = (0..300_000u32).map(|i| (i * 7) as u8).collect();
    assert_eq!(kvpool(&ep, &["put", "a"], &value).0, 0);
    let file = std::env::temp_dir().join(format!("kvpool-cli-value-{}", std::process::id()));
    std::fs::write(&file, b"from a file").unwrap();
    assert_eq!(kvpool(&ep, &["put", "b", file.to_str().unwrap()], b"").0, 0);
    let (code, out, _) = kvpool(&ep, &["get", "a"], b"");
    assert_eq!((code, out), (0, value.clone()));
    let (code, out, _) = kvpool(&ep, &["--no-local", "get", "b"], b"");
    assert_eq!((code, out), (0, b"from a file".to_vec()));
    let (code, _, err) = kvpool(&ep, &["get", "zzz"], b"");
    assert_eq!(code, 1, "a miss exits 1");
    assert!(err.contains("miss"));
    let (code, out, _) = kvpool(&ep, &["exists", "a", "b", "zzz", "a"], b"");
    assert_eq!((code, String::from_utf8(out).unwrap().trim()), (0, "2"));
    let (code, out, _) = kvpool(&ep, &["--hex", "exists", "61"], b"");
    assert_eq!(
        (code, String::from_utf8(out).unwrap().trim()),
        (0, "1"),
        "hex keys"
    );
    let (code, out, _) = kvpool(&ep, &["rm", "a", "zzz"], b"");
    assert_eq!((code, String::from_utf8(out).unwrap().trim()), (0, "1"));
    let (code, out, _) = kvpool(&ep, &["stats", "--json"], b"");
    let json = String::from_utf8(out).unwrap();
    assert_eq!(code, 0);
    assert!(json.contains("\"objects\":1"), "{json}");
    assert!(json.contains("\"disk\":null"), "{json}");
    let (code, out, _) = kvpool(&ep, &["stats"], b"");
    assert_eq!(code, 0);
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("namespace \"default\": 1 objects"), "{text}");
    assert!(text.contains("disk tier: off"), "{text}");
    let (code, out, _) = kvpool(&ep, &["rm", "--all"], b"");
    assert_eq!((code, String::from_utf8(out).unwrap().trim()), (0, "1"));
    let (code, _, _) = kvpool(&ep, &["get", "b"], b"");
    assert_eq!(code, 1, "rm --all removed the last object");
    let (code, _, err) = kvpool(&ep, &["-n", "nope", "stats"], b"");
    assert_eq!(code, 2);
    assert!(err.contains("unknown namespace"), "{err}");
    let (code, _, err) = kvpool("http://x", &["stats"], b"");
    assert_eq!(code, 2);
    assert!(err.contains("bad endpoint"), "{err}");
    let _ = std::fs::remove_file(file);
}

#[test]
fn prefix_hash_match_and_stats() {
    let (_d, ep) = start();
    let tokens: Vec<String> = (0..40u32)
        .map(|i| ((i * 7919 + 13) % 128_256).to_string())
        .collect();
    let seed = [
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--dtype",
        "bf16",
        "--layers",
        "0:32",
    ];
    let mut args = vec!["prefix", "hash"];
    args.extend(seed);
    args.extend(tokens.iter().map(|t| t.as_str()));
    let (code, out, _) = kvpool(&ep, &args, b"");
    let keys: Vec<String> = String::from_utf8(out)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(code, 0);
    // docs/HASHING.md, vector 4: two full blocks, the partial third has no key.
    assert_eq!(
        keys,
        [
            "d6b59af9d93d8c0c96d5a2e1cf66e586",
            "d5ba403033fc666ade3127daa14a891d"
        ]
    );
    // Tokens on stdin give the same keys, and need no node.
    let mut args = vec!["prefix", "hash"];
    args.extend(seed);
    let (_, out, _) = kvpool("tcp://127.0.0.1:1", &args, tokens.join(" ").as_bytes());
    assert_eq!(String::from_utf8(out).unwrap().lines().count(), 2);

    let mut matching = vec!["prefix", "match"];
    matching.extend(seed);
    matching.extend(tokens.iter().map(|t| t.as_str()));
    let (code, out, _) = kvpool(&ep, &matching, b"");
    assert_eq!(
        (code, String::from_utf8(out).unwrap().trim().to_string()),
        (1, "0".to_string())
    );
    assert_eq!(kvpool(&ep, &["--hex", "put", &keys[0]], b"block 0").0, 0);
    let (code, out, _) = kvpool(&ep, &matching, b"");
    assert_eq!(
        (code, String::from_utf8(out).unwrap().trim().to_string()),
        (0, "1".to_string())
    );
    assert_eq!(kvpool(&ep, &["--hex", "put", &keys[1]], b"block 1").0, 0);
    let (_, out, _) = kvpool(&ep, &matching, b"");
    assert_eq!(String::from_utf8(out).unwrap().trim(), "2");
    let (code, out, _) = kvpool(&ep, &["prefix", "stats"], b"");
    let text = String::from_utf8(out).unwrap();
    assert_eq!(code, 0);
    let row = text
        .lines()
        .find(|l| l.starts_with("default"))
        .expect("a row per namespace");
    // 3 matches of 2 blocks each asked 6 blocks and matched 0 + 1 + 2.
    assert!(
        row.split_whitespace().collect::<Vec<_>>()[1..4] == ["2", "6", "3"],
        "{text}"
    );
}

/// Every `--json` output is valid JSON, even for a namespace whose name needs escaping (a quote,
/// a backslash, a newline, control characters and non-ASCII), and carries what it says.
#[test]
fn json_outputs_parse() {
    let weird = "t\"e\\n\u{1}\u{7f}\u{e9}\nline";
    let cfg = std::env::temp_dir().join(format!("kvpool-cli-json-{}.toml", std::process::id()));
    std::fs::write(
        &cfg,
        "[[namespace]]\nname = \"t\\\"e\\\\n\\u0001\\u007F\\u00E9\\nline\"\n",
    )
    .unwrap();
    let (_d, ep) = start_with(&["--config", cfg.to_str().unwrap()]);
    assert_eq!(kvpool(&ep, &["-n", weird, "put", "k\"\\"], b"v").0, 0);

    let parse = |args: &[&str]| -> serde_json::Value {
        let (code, out, err) = kvpool(&ep, args, b"");
        assert_eq!(code, 0, "{args:?}: {err}");
        let text = String::from_utf8(out).unwrap();
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{args:?}: {e}: {text}"))
    };
    let stats = parse(&["-n", weird, "stats", "--json"]);
    assert_eq!(stats["objects"], 1, "{stats}");
    let ns = stats["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == weird)
        .unwrap_or_else(|| panic!("no namespace {weird:?} in {stats}"));
    assert_eq!(ns["objects"], 1);
    assert_eq!(stats["segments"][0]["capacity"], 32u64 << 20);

    let view = parse(&["cluster", "status", "--json"]);
    let nodes = view["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 1, "{view}");
    assert_eq!(nodes[0]["state"], "serving", "{view}");
    assert_eq!(
        format!("tcp://{}", nodes[0]["tcp"].as_str().unwrap()),
        ep,
        "{view}"
    );
    assert_eq!(nodes[0]["objects"], 1, "{view}");
    assert!(view["version"].is_u64(), "{view}");
    let _ = std::fs::remove_file(cfg);
}

/// `kvpool keys PREFIX` lists the keys with the prefix, sorted, one per line; a key that is not
/// printable text is escaped, and `--hex` lists hex.
#[test]
fn keys_lists_a_prefix_one_per_line() {
    let (_d, ep) = start();
    for k in ["manifest/b", "manifest/a", "chunk/a"] {
        assert_eq!(kvpool(&ep, &["put", k], b"v").0, 0);
    }
    assert_eq!(kvpool(&ep, &["--hex", "put", "6d0a5c"], b"v").0, 0);
    let (code, out, err) = kvpool(&ep, &["keys", "manifest/"], b"");
    assert_eq!(code, 0, "{err}");
    assert_eq!(String::from_utf8(out).unwrap(), "manifest/a\nmanifest/b\n");
    let (_, out, _) = kvpool(&ep, &["keys", "m"], b"");
    assert_eq!(
        String::from_utf8(out).unwrap(),
        "m\\n\\\\\nmanifest/a\nmanifest/b\n",
        "a newline and a backslash are escaped"
    );
    let (_, out, _) = kvpool(&ep, &["--hex", "keys", "6d0a"], b"");
    assert_eq!(String::from_utf8(out).unwrap(), "6d0a5c\n");
    let (code, out, _) = kvpool(&ep, &["keys", "nothing/"], b"");
    assert_eq!((code, out), (0, Vec::new()));
    let (_, out, _) = kvpool(&ep, &["keys"], b"");
    assert_eq!(String::from_utf8(out).unwrap().lines().count(), 4);
}

#[test]
fn stats_show_the_disk_tier() {
    let disk = temp_dir("cli-disk");
    let (_node, ep) = start_with(&[
        "--disk-path",
        disk.to_str().unwrap(),
        "--disk-capacity",
        "64MiB",
        "--disk-region-size",
        "4MiB",
    ]);
    let (code, out, _) = kvpool(&ep, &["stats", "--json"], b"");
    assert_eq!(code, 0);
    let json: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(json["disk"]["capacity"], 64 << 20, "{json}");
    assert_eq!(json["disk"]["objects"], 0, "{json}");
    let (code, out, _) = kvpool(&ep, &["stats"], b"");
    assert_eq!(code, 0);
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("disk tier: 0 objects"), "{text}");
    assert!(text.contains("promoted 0"), "{text}");
}

/// `kvpool events ARGS` running, its lines as they come; a key under `ev/` is put again and
/// again until the first line shows the subscription is in place.
fn events_running(
    ep: &str,
    args: &[&str],
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvpool"))
        .args(["--endpoint", ep, "events"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    (child, rx)
}

/// The next line of `rx`, putting `ev/warm` meanwhile (until a line comes, for at most 30 s).
fn next_line(ep: &str, rx: &std::sync::mpsc::Receiver<String>) -> String {
    let t = std::time::Instant::now();
    loop {
        if let Ok(line) = rx.recv_timeout(std::time::Duration::from_millis(200)) {
            return line;
        }
        assert!(t.elapsed().as_secs() < 30, "no event line");
        assert_eq!(kvpool(ep, &["put", "ev/warm"], b"w").0, 0);
    }
}

#[test]
fn events_prints_one_line_per_event() {
    let (_d, ep) = start();
    let (mut child, rx) = events_running(&ep, &["--prefix", "ev/"]);
    assert_eq!(next_line(&ep, &rx), "stored dram ev/warm");
    assert_eq!(kvpool(&ep, &["put", "other"], b"x").0, 0);
    assert_eq!(kvpool(&ep, &["put", "ev/a"], b"x").0, 0);
    assert_eq!(kvpool(&ep, &["rm", "ev/a"], b"").0, 0);
    assert_eq!(kvpool(&ep, &["rm", "--all"], b"").0, 0);
    let mut lines = Vec::new();
    while lines.last().map(String::as_str) != Some("cleared dram ") {
        let line = rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("the clear's line");
        if line != "stored dram ev/warm" {
            lines.push(line);
        }
    }
    assert_eq!(
        lines,
        [
            "stored dram ev/a",
            "removed dram ev/a",
            "removed dram ev/warm",
            "cleared dram "
        ]
    );
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn events_json_lines_stop_after_count() {
    let (_d, ep) = start();
    let (mut child, rx) = events_running(&ep, &["--json", "--count", "2", "--prefix", "ev/"]);
    let first: serde_json::Value = serde_json::from_str(&next_line(&ep, &rx)).unwrap();
    assert_eq!(first["kind"], "stored");
    assert_eq!(first["tier"], "dram");
    assert_eq!(first["key"], "ev/warm");
    assert_eq!(first["node"], 0);
    let second: serde_json::Value = serde_json::from_str(&next_line(&ep, &rx)).unwrap();
    assert_eq!(second["seq"], first["seq"].as_u64().unwrap() + 1);
    let status = child.wait().unwrap();
    assert!(status.success(), "--count ends it");
}
