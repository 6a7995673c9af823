//! `kvpoold`'s configuration precedence: flags over environment over file over defaults.

use std::process::Command;

use kvpool_system_tests::bin;

fn print_config(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = Command::new(bin("kvpoold"))
        .args(args)
        .arg("--print-config")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn flags_beat_environment_beat_file() {
    let dir = std::env::temp_dir().join(format!("kvpoold-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("kvpoold.toml");
    std::fs::write(
        &file,
        "node_id = 3\n[memory]\nsize = \"256MiB\"\n[listen]\ntcp = \"127.0.0.1:9000\"\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();

    let c = print_config(&["--config", f], &[]);
    assert!(
        c.contains("node_id: 3")
            && c.contains("size: 268435456")
            && c.contains("\"127.0.0.1:9000\""),
        "{c}"
    );

    let c = print_config(
        &["--config", f],
        &[
            ("KVPOOL_MEMORY", "128MiB"),
            ("KVPOOL_TCP", "127.0.0.1:9001"),
        ],
    );
    assert!(
        c.contains("size: 134217728") && c.contains("\"127.0.0.1:9001\""),
        "{c}"
    );

    let c = print_config(
        &["--config", f, "--memory", "64MiB"],
        &[("KVPOOL_MEMORY", "128MiB")],
    );
    assert!(c.contains("size: 67108864"), "{c}");

    let defaults = print_config(&[], &[]);
    assert!(
        defaults.contains("size: 1073741824")
            && defaults.contains("\"127.0.0.1:7370\"")
            && defaults.contains("\"127.0.0.1:7371\"")
    );

    let bad = Command::new(bin("kvpoold"))
        .args(["--memory", "lots"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("bad size"));
    std::fs::write(&file, "mystery = 1\n").unwrap();
    let bad = Command::new(bin("kvpoold"))
        .args(["--config", f])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("unknown field"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    let _ = std::fs::remove_dir_all(dir);
}
