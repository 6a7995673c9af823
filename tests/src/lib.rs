//! The one harness that every test starting `kvpoold` uses: real `kvpoold` processes on free
//! loopback ports, each with its own data directory, stopped (SIGTERM, then SIGKILL) when
//! dropped; and [`bin`], which finds the workspace's binaries. Only std, so that the tests of
//! any crate in the workspace can depend on it.

pub mod deps;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A `kvpoold` child process.
pub struct Node {
    /// The process, until [`Node::stop`] takes it.
    pub child: Option<Child>,
    /// Its data directory, removed on drop unless the node was stopped.
    pub dir: PathBuf,
    /// The TCP address it listens on, from its ready line (`off` when off).
    pub tcp: String,
    /// The QUIC address (`off` when off).
    pub quic: String,
    /// The metrics address (`off` when off).
    pub metrics: String,
    /// The Unix socket path (`off` when off).
    pub unix: String,
    /// The Redis-protocol front door's address (`off` unless started with `--resp`).
    pub resp: String,
    /// The native protocol over TLS (`off` unless started with `--tls`).
    pub tls: String,
    keep_dir: bool,
}

/// Path of a workspace binary, built next to this test executable (`target/<profile>/`).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let p = dir.join(name);
    if !p.exists() {
        // `cargo test --workspace` builds every binary; a narrower invocation may not have.
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let release = dir.ends_with("release");
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-p", "kvpool-server", "-p", "kvpool-cli", "--bins"]);
        if release {
            cmd.arg("--release");
        }
        let ok = cmd.status().map(|s| s.success()).unwrap_or(false);
        assert!(ok && p.exists(), "could not build {}", p.display());
    }
    p
}

/// A fresh, unique temporary directory.
pub fn temp_dir(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let d = std::env::temp_dir().join(format!(
        "kvpool-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

impl Node {
    /// Starts a node with `--memory <memory>` and extra flags, on free ports.
    pub fn start(memory: &str, extra: &[&str]) -> Node {
        Node::start_in(temp_dir("node"), memory, extra, &["127.0.0.1:0"; 3])
    }

    /// Starts a node in `dir` with explicit tcp, quic and metrics addresses.
    pub fn start_in(dir: PathBuf, memory: &str, extra: &[&str], addrs: &[&str; 3]) -> Node {
        Node::launch(
            Command::new(bin("kvpoold")),
            dir,
            memory,
            extra,
            addrs,
            None,
        )
    }

    /// Starts a node like [`Node::start`], its command line prefixed by `wrapper` (e.g.
    /// `prlimit --nofile=128:128`), with `KVPOOL_LOG=warn` and its log captured line by line.
    pub fn start_logged(wrapper: &[&str], memory: &str, extra: &[&str]) -> (Node, Log) {
        Node::start_logged_at(wrapper, memory, extra, &["127.0.0.1:0"; 3])
    }

    /// [`Node::start_logged`] with explicit tcp, quic and metrics addresses (e.g. inside a
    /// network namespace, the wrapper being `ip netns exec <ns>`).
    pub fn start_logged_at(
        wrapper: &[&str],
        memory: &str,
        extra: &[&str],
        addrs: &[&str; 3],
    ) -> (Node, Log) {
        let kvpoold = bin("kvpoold");
        let cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&kvpoold);
                c
            }
            None => Command::new(&kvpoold),
        };
        let log = Log::default();
        let node = Node::launch(cmd, temp_dir("node"), memory, extra, addrs, Some(&log));
        (node, log)
    }

    /// Runs `cmd` (kvpoold, perhaps behind a wrapper) on `dir` and waits for its ready line;
    /// with `log`, its stderr is captured there instead of passed through.
    fn launch(
        mut cmd: Command,
        dir: PathBuf,
        memory: &str,
        extra: &[&str],
        addrs: &[&str; 3],
        log: Option<&Log>,
    ) -> Node {
        let mut child = cmd
            .args(["--data-dir", dir.to_str().unwrap(), "--memory", memory])
            .args(["--tcp", addrs[0], "--quic", addrs[1], "--metrics", addrs[2]])
            .args(extra)
            .env("KVPOOL_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(if log.is_some() {
                Stdio::piped()
            } else {
                Stdio::inherit()
            })
            .spawn()
            .expect("spawning kvpoold");
        if let Some(log) = log {
            let stderr = child.stderr.take().unwrap();
            let lines = log.clone();
            std::thread::spawn(move || {
                for l in BufReader::new(stderr).lines().map_while(Result::ok) {
                    lines.0.lock().unwrap().push(l);
                }
            });
        }
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(l)) = lines.next() {
                let _ = tx.send(l);
            }
            for _ in lines {}
        });
        let Ok(line) = rx.recv_timeout(Duration::from_secs(30)) else {
            let _ = child.kill();
            let logged = log.map(|l| l.lines().join("\n")).unwrap_or_default();
            panic!("kvpoold did not become ready: {:?}\n{logged}", child.wait());
        };
        let field = |k: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{k}=")))
                .unwrap_or("off")
                .to_string()
        };
        Node {
            tcp: field("tcp"),
            quic: field("quic"),
            metrics: field("metrics"),
            unix: field("unix"),
            resp: field("resp"),
            tls: field("tls"),
            child: Some(child),
            dir,
            keep_dir: false,
        }
    }

    /// The process id of the running node.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Resident memory of the node, bytes (`VmRSS` in `/proc/<pid>/status`).
    pub fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .expect("VmRSS in /proc/<pid>/status");
        kib << 10
    }

    /// `tcp://<addr>`.
    pub fn tcp_url(&self) -> String {
        format!("tcp://{}", self.tcp)
    }

    /// `quic://<addr>`.
    pub fn quic_url(&self) -> String {
        format!("quic://{}", self.quic)
    }

    /// `unix://<path>`.
    pub fn unix_url(&self) -> String {
        format!("unix://{}", self.unix)
    }

    /// The self-signed certificate it wrote for QUIC.
    pub fn cert(&self) -> PathBuf {
        self.dir.join("tls-cert.pem")
    }

    /// The cluster secret this node generated (it was started without peers or a secret):
    /// what nodes joining it are started with (`--cluster-secret-file`).
    pub fn secret_file(&self) -> PathBuf {
        self.dir.join("cluster.secret")
    }

    /// SIGKILL and wait (a crash: nothing of the daemon runs after). Keeps the data dir.
    pub fn kill(&mut self) {
        self.keep_dir = true;
        let mut child = self.child.take().expect("running");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// SIGTERM and wait; returns the exit status. Keeps the data dir for a restart.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        self.keep_dir = true;
        let mut child = self.child.take().expect("running");
        unsafe_kill(child.id(), 15);
        for _ in 0..200 {
            if let Some(s) = child.try_wait().unwrap() {
                return s;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        panic!("kvpoold did not stop on SIGTERM within 10 s");
    }

    /// Fetches `/metrics`.
    pub fn scrape(&self) -> String {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&self.metrics).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if !self.keep_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The value of the series `series` on a metrics page: its name, with its labels as the page
/// writes them (`kvpool_x_total{node="0"}`); None when absent.
pub fn metric(page: &str, series: &str) -> Option<u64> {
    page.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// A node's log (stderr), as it is written.
#[derive(Clone, Default)]
pub struct Log(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Log {
    /// Every line so far.
    pub fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }

    /// How many lines so far contain `needle`.
    pub fn count(&self, needle: &str) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }
}

fn unsafe_kill(pid: u32, sig: i32) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status();
}

/// Writes a cluster secret derived from `seed` (64 hex digits, mode 0600) to `path`.
pub fn write_secret(path: &Path, seed: u64) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let hex: String = value(seed, 32).iter().map(|b| format!("{b:02x}")).collect();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .unwrap();
    writeln!(f, "{hex}").unwrap();
}

/// Deterministic bytes for a value.
pub fn value(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[cfg(test)]
mod tests {
    /// `autotests = false`: a test file without a `[[test]]` entry would never run, silently.
    #[test]
    fn every_test_file_is_declared() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        for entry in std::fs::read_dir(dir).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            let Some(stem) = name.strip_suffix(".rs") else {
                continue;
            };
            // The core's loom tests belong to the `kvpool` package; `common.rs` is a module.
            if stem == "common" || stem.starts_with("loom_") {
                continue;
            }
            assert!(
                manifest.contains(&format!("path = \"{name}\"")),
                "tests/{name} has no [[test]] entry in tests/Cargo.toml, so it never runs"
            );
        }
    }
}
