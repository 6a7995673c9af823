//! `kvpool-bench tier` end to end at small sizes, so the benchmark cannot rot: the interference
//! part runs a pair of daemons (without and with a disk tier) and reports every run and the
//! ratio; the restart part fills a tier, restarts the daemon twice on it and reads back every
//! sampled object. The tier goes in a temporary directory whatever its file system
//! (`--any-fs`): nothing here asserts on speed.
#![cfg(not(loom))]

mod common;

fn run(args: &[&str]) -> String {
    let out = std::process::Command::new(common::bench_bin())
        .args(args)
        .arg("--kvpoold")
        .arg(common::bin("kvpoold"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "kvpool-bench {} failed: {}\n{stdout}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn tier_interference_runs_a_pair_and_reports_the_ratio() {
    let dir = common::temp_dir("tier-interference");
    let stdout = run(&[
        "tier",
        "interference",
        "--pairs",
        "1",
        "--window-ms",
        "300",
        "--memory",
        "64MiB",
        "--put-size",
        "256KiB",
        "--disk-capacity",
        "64MiB",
        "--disk-region-size",
        "4MiB",
        "--any-fs",
        "--disk-dir",
        dir.to_str().unwrap(),
    ]);
    for want in [
        "  0     off ",
        "  0     on ",
        "p99 with the tier demoting / p99 without",
    ] {
        assert!(stdout.contains(want), "no {want:?} in:\n{stdout}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tier_restart_recovers_every_object_it_put_on_disk() {
    let dir = common::temp_dir("tier-restart");
    let stdout = run(&[
        "tier",
        "restart",
        "--objects",
        "3000",
        "--memory",
        "64MiB",
        "--disk-region-size",
        "4MiB",
        "--keep-free",
        "1",
        "--any-fs",
        "--disk-dir",
        dir.to_str().unwrap(),
    ]);
    let restarts: Vec<&str> = stdout.lines().filter(|l| l.contains("restart, ")).collect();
    assert_eq!(restarts.len(), 2, "{stdout}");
    for l in restarts {
        assert!(l.contains("1000 of 1000 sampled objects"), "{l}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
