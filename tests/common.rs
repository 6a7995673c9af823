//! What every whole-system test binary shares: the harness (the `kvpool-system-tests` library,
//! re-exported) and the multi-node helpers, which drive the client.

#![allow(
    dead_code,
    unreachable_pub,
    unused_imports,
    reason = "each test binary uses a different subset"
)]

pub mod cluster;
pub mod etcd;
pub mod history;
pub mod raw;

pub use kvpool_system_tests::*;

/// The `kvpool-bench` binary of this profile, brought up to date first (`cargo test` builds
/// the bench's test harness, not its binary, so one left by an older build could be stale).
pub fn bench_bin() -> std::path::PathBuf {
    static BUILT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let kvpoold = bin("kvpoold");
    let dir = kvpoold.parent().expect("target/<profile>").to_path_buf();
    let p = dir.join("kvpool-bench");
    let ok = *BUILT.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = std::process::Command::new(cargo);
        cmd.args(["build", "-p", "kvpool-bench", "--bins"]);
        if dir.ends_with("release") {
            cmd.arg("--release");
        }
        cmd.status().map(|s| s.success()).unwrap_or(false)
    });
    assert!(ok && p.exists(), "could not build {}", p.display());
    p
}

/// Runs `kvpool-bench` with `args` against this profile's kvpoold, writing its JSON report to
/// `json`; asserts it succeeded and returns its stdout and the parsed report.
pub fn run_bench(args: &[&str], json: &std::path::Path) -> (String, serde_json::Value) {
    let out = std::process::Command::new(bench_bin())
        .args(args)
        .arg("--kvpoold")
        .arg(bin("kvpoold"))
        .arg("--json")
        .arg(json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "kvpool-bench {} failed: {}\n{stdout}",
        args.first().copied().unwrap_or(""),
        String::from_utf8_lossy(&out.stderr)
    );
    let doc = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    (stdout, doc)
}
