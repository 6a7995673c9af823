//! `kvpool-bench fabric` end to end at small sizes, so the benchmark cannot rot: over the tcp
//! and shm providers, every contender at each depth reports GB/s and its ratio to the bare
//! `fi_read` loop, the fabric layer and `fabric://` gets their verdict, and small gets their
//! latency with the fabric off and on. Nothing here asserts on speed.
#![cfg(not(loom))]

mod common;

#[test]
fn fabric_bench_runs_and_reports_every_row() {
    if !kvpool_system_tests::deps::require(
        kvpool_fabric::AVAILABLE,
        "fabric_bench_runs_and_reports_every_row",
        "libfabric",
        "apt-get install libfabric-dev libfabric-bin libclang-dev, then rebuild",
    ) {
        return;
    }
    let dir = common::temp_dir("fabric-bench");
    let json = dir.join("fabric.json");
    let (stdout, doc) = common::run_bench(
        &[
            "fabric",
            "--size",
            "256KiB",
            "--depths",
            "1,4",
            "--duration-ms",
            "50",
            "--pairs",
            "2",
            "--latency-ms",
            "50",
        ],
        &json,
    );
    let rows = doc["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2 * 2 * 5, "{stdout}");
    for r in rows {
        assert_eq!(r["gbps_runs"].as_array().unwrap().len(), 2);
        assert!(r["gbps"].as_f64().unwrap() > 0.0, "{r}");
        let (lo, hi) = (
            r["ratio_min"].as_f64().unwrap(),
            r["ratio_max"].as_f64().unwrap(),
        );
        assert!(lo > 0.0 && lo <= hi, "{r}");
        let what = r["what"].as_str().unwrap();
        if what.starts_with("kvpool_fabric") || what.contains("fabric://") {
            assert_eq!(r["goal"], 0.8);
            assert_eq!(r["met"].as_bool().unwrap(), lo >= 0.8);
        } else {
            assert!(r["met"].is_null(), "{r}");
        }
    }
    assert!(stdout.contains("goal ≥0.8× by the lowest"), "{stdout}");
    // The progress cost: small gets timed with the fabric off and on, idle and under load.
    let latency = doc["latency"].as_array().unwrap();
    assert_eq!(latency.len(), 2 * 4, "{stdout}");
    for r in latency {
        let (p50, p99) = (r["p50_us"].as_f64().unwrap(), r["p99_us"].as_f64().unwrap());
        assert!(p50 > 0.0 && p50 <= p99, "{r}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
