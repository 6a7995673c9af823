//! `kvpool-bench weights` end to end on a small checkpoint, so the benchmark cannot rot: it
//! generates the file, starts its own daemons (one, then two as a pool), publishes, loads on
//! both paths, checks every loaded byte against the file, and reports each goal with its
//! verdict. Nothing here asserts on speed.
#![cfg(not(loom))]

mod common;

#[test]
fn weights_bench_runs_and_reports_every_goal() {
    let dir = common::temp_dir("weights-bench");
    let json = dir.join("weights.json");
    let (stdout, doc) = common::run_bench(
        &[
            "weights",
            "--size",
            "32MiB",
            "--reps",
            "1",
            "--latency-reps",
            "2",
            "--dir",
            dir.to_str().unwrap(),
        ],
        &json,
    );
    let rows = doc["rows"].as_array().unwrap();
    let row = |what: &str, phase: &str| {
        rows.iter()
            .find(|r| r["what"] == what && r["phase"].as_str().unwrap().starts_with(phase))
            .unwrap_or_else(|| panic!("no row {what:?} in {phase:?}:\n{stdout}"))
    };
    assert!(doc["model"].as_str().unwrap().contains("Llama-style bf16"));
    const PUBLISH: &str = "Weights::publish, cold (a fresh daemon each run)";
    let bytes = row(PUBLISH, "same host")["bytes"].clone();
    assert!(bytes.as_u64().unwrap() > 30 << 20);
    // The three goals, each against its reference of the same run.
    for (what, phase, reference, goal) in [
        (PUBLISH, "same host", "file read", 0.8),
        ("Weights::load_into, warm", "same host", "memcpy", 0.9),
        ("Weights::load_into, warm", "loopback TCP", "raw TCP", 0.8),
    ] {
        let r = row(what, phase);
        assert_eq!(r["bytes"], bytes, "{what}: the same tensors");
        let vs = &r["vs"];
        assert_eq!(vs["reference"], reference);
        assert_eq!(vs["goal"], goal);
        let ratio = vs["ratio"].as_f64().unwrap();
        assert!(ratio > 0.0);
        // Each run against the reference run it alternated with; judged by the lowest.
        let (lo, hi) = (
            vs["ratio_min"].as_f64().unwrap(),
            vs["ratio_max"].as_f64().unwrap(),
        );
        assert!(lo <= ratio && ratio <= hi, "{lo} {ratio} {hi}");
        assert_eq!(vs["met"].as_bool().unwrap(), lo >= goal);
        assert!(r["gbps"].as_f64().unwrap() > 0.0);
    }
    for reference in [
        "read() of the file (reference)",
        "memcpy, buffer to buffer (reference)",
    ] {
        assert!(row(reference, "same host")["gbps"].as_f64().unwrap() > 0.0);
    }
    row("raw TCP stream, 1 connection (reference)", "loopback TCP");
    // Time to the first tensor, on both paths.
    for phase in ["same host", "loopback TCP"] {
        let r = row("Weights::tensor, tensor 0 (lm_head.weight)", phase);
        assert_eq!(r["secs"].as_array().unwrap().len(), 2);
        assert!(r["p99_s"].as_f64().unwrap() > 0.0);
    }
    assert!(stdout.contains("goal ≥0.9× by the lowest pair"), "{stdout}");
    // The generated file went with the run's own directory.
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "weights.json")
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
