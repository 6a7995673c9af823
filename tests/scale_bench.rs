//! `kvpool-bench scale` end to end on four nodes, so the benchmark cannot rot: with static peers
//! and with an etcd of its own, it starts the pool, measures its idle traffic, writes a key set,
//! has a node join, one drain and one be killed, reads every key back, and measures routing and
//! memory per object. Checked: nothing read back wrong, the killed node's share (and only a
//! share) missed, a join and a drain moved part of the keys and the nodes handed those over, the
//! traffic was counted. Nothing here asserts on time. Without an `etcd` binary (Debian: `apt-get
//! install etcd-server`) it fails in CI and says SKIPPED elsewhere.
#![cfg(not(loom))]

mod common;

#[test]
fn scale_bench_runs_both_memberships_and_reads_nothing_wrong() {
    let etcd = ["/usr/bin/etcd", "/usr/local/bin/etcd"]
        .iter()
        .any(|p| std::path::Path::new(p).is_file());
    if !common::deps::require(
        etcd,
        "scale_bench_runs_both_memberships_and_reads_nothing_wrong",
        "etcd",
        "apt-get install etcd-server",
    ) {
        return;
    }
    let dir = common::temp_dir("scale-bench");
    let json = dir.join("scale.json");
    let (stdout, doc) = common::run_bench(
        &[
            "scale",
            "--nodes",
            "4",
            "--keys",
            "1000",
            "--settle-s",
            "0",
            "--window-s",
            "1",
            "--timeout-s",
            "60",
            "--metadata-memory",
            "16MiB",
            "--routing-reps",
            "1",
        ],
        &json,
    );
    let modes = doc["modes"].as_array().unwrap();
    assert_eq!(modes.len(), 2, "{stdout}");
    for m in modes {
        let f = |k: &str| m[k].as_f64().unwrap_or_else(|| panic!("{k} in {m}"));
        assert_eq!(m["wrong"], 0, "{stdout}");
        assert_eq!(
            m["live"], 3,
            "4 started, one joined, one drained, one killed"
        );
        // The killed node owned about a third of the keys: they miss, the rest read back.
        let misses = m["misses"].as_u64().unwrap();
        assert!(misses > 0 && misses < 1000, "{stdout}");
        assert!(f("hits") > 0.3, "{stdout}");
        for moved in ["join_moved", "drain_moved"] {
            assert!(f(moved) > 0.0 && f(moved) < 0.6, "{moved}: {stdout}");
        }
        assert!(f("join_handed") > 0.0, "{stdout}");
        assert!(f("drain_handed") > 0.0, "{stdout}");
    }
    let stat = &modes[0];
    assert_eq!(stat["mode"], "static");
    assert!(stat["heartbeats_in_per_node_s"].as_f64().unwrap() > 0.0);
    assert!(stat["bytes_per_node_s"].as_f64().unwrap() > 0.0, "{stdout}");
    let etcd = &modes[1];
    assert_eq!(etcd["mode"], "etcd");
    assert!(etcd["etcd_messages_per_node_s"].as_f64().unwrap() > 0.0);
    let routing = doc["routing"].as_array().unwrap();
    assert_eq!(routing[0]["nodes"], 3);
    assert_eq!(routing[1]["nodes"], 4);
    for m in doc["metadata"].as_array().unwrap() {
        assert!(m["objects"].as_u64().unwrap() > 0, "{m}");
        assert!(m["reserved_per_object"].as_f64().unwrap() >= m["size"].as_f64().unwrap());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
