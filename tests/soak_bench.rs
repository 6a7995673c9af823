//! `kvpool-bench soak` end to end for ten seconds, so the benchmark cannot rot: it starts its own
//! kvpoold with a small pool, runs the mixed load (same-host and TCP clients, every operation
//! kind, abandoned two-phase puts, reconnecting clients), and reports every sample, the
//! reclaimed allocations and the verdict with its rules. Every read is checked: none may be
//! wrong. Nothing here asserts on speed or on flatness (ten seconds say nothing about a leak).
#![cfg(not(loom))]

mod common;

#[test]
fn soak_bench_reports_every_sample_and_no_wrong_read() {
    let dir = common::temp_dir("soak-bench");
    let json = dir.join("soak.json");
    let (stdout, doc) = common::run_bench(
        &[
            "soak",
            "--seconds",
            "10",
            "--sample-every",
            "2",
            "--memory",
            "128MiB",
            "--clients",
            "2",
            "--pending-timeout-ms",
            "1000",
        ],
        &json,
    );
    // t = 0, 2, ..., 10.
    let samples = doc["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 6, "{stdout}");
    for (i, s) in samples.iter().enumerate() {
        assert!(
            (s["t_s"].as_f64().unwrap() - 2.0 * i as f64).abs() < 2.0,
            "{s}"
        );
        assert!(s["rss_bytes"].as_u64().unwrap() > 0, "{s}");
        assert!(s["fds"].as_u64().unwrap() > 0, "{s}");
        for gauge in ["pending_allocations", "connections", "objects", "ops_per_s"] {
            assert!(s[gauge].as_f64().is_some(), "{gauge} in {s}");
        }
        assert_eq!(s["wrong"], 0, "{stdout}");
    }
    // The load ran and read: every kind of operation, hits among the reads, nothing wrong.
    let totals = &doc["totals"];
    assert_eq!(totals["wrong"], 0, "{stdout}");
    assert_eq!(totals["wrong_bytes"], 0, "{stdout}");
    assert!(totals["hits"].as_u64().unwrap() > 0, "{stdout}");
    for op in totals["by_op"].as_array().unwrap() {
        assert!(
            op["count"].as_u64().unwrap() > 0,
            "{op} never ran:\n{stdout}"
        );
    }
    assert!(samples.last().unwrap()["objects"].as_f64().unwrap() > 0.0);
    assert_eq!(doc["same_host_clients"], 1, "{stdout}");
    // Abandoned allocations were reclaimed once the load stopped.
    let after = &doc["after"];
    assert_eq!(after["drained"], true, "{stdout}");
    assert!(
        after["sample"]["reaped"].as_f64().unwrap() > 0.0,
        "{stdout}"
    );
    // The verdict names each gauge with its figures and rule, and the overall result.
    let verdict = &doc["verdict"];
    for gauge in ["rss", "fds", "pending"] {
        let g = &verdict[gauge];
        for field in ["min", "max", "slope_per_min", "drift", "drift_limit"] {
            assert!(g[field].is_number(), "{gauge}.{field}: {g}");
        }
        assert_eq!(g["range_limit"].is_null(), gauge == "pending", "{g}");
        assert!(g["flat"].is_boolean() && g["rule"].is_string(), "{g}");
    }
    assert_eq!(verdict["wrong"], 0);
    assert!(verdict["met"].is_boolean());
    assert!(stdout.contains("verdict: "), "{stdout}");
    std::fs::remove_dir_all(&dir).unwrap();
}
