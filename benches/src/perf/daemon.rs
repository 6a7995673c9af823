//! A `kvpoold` child process for the benchmark: its own data directory, ports picked by the
//! OS, stopped (SIGTERM, then SIGKILL) and cleaned up when dropped — also on early exit.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// Least memory the benchmark daemon contributes.
const MIN_MEMORY: u64 = 2 << 30;

/// Memory for a daemon that must hold `stored` bytes of values without evicting any: half as
/// much again for page rounding and for overwrites (a put allocates the new value before the
/// old one is freed), at least [`MIN_MEMORY`], in whole 256 MiB.
pub(crate) fn memory_for(stored: u64) -> u64 {
    (stored + stored / 2)
        .max(MIN_MEMORY)
        .next_multiple_of(256 << 20)
}

/// A running `kvpoold`.
pub(crate) struct Daemon {
    child: Child,
    dir: PathBuf,
    /// TCP address (`host:port`).
    pub(crate) tcp: String,
    /// QUIC address (`host:port`).
    pub(crate) quic: String,
    /// Prometheus endpoint (`host:port`), serving `/metrics`.
    pub(crate) metrics: String,
    /// Value sizes whose data set is already stored.
    pub(crate) loaded: Vec<u64>,
}

impl Daemon {
    /// The cluster secret a node started without peers generated: nodes joining it are
    /// started with `--cluster-secret-file` and this path.
    pub(crate) fn secret_file(&self) -> PathBuf {
        self.dir.join("cluster.secret")
    }

    /// Starts `binary` with `memory` bytes and waits for its ready line.
    pub(crate) fn start(binary: &Path, memory: u64) -> anyhow::Result<Daemon> {
        Daemon::start_with(binary, memory, &[])
    }

    /// [`Daemon::start`] with extra flags (node id, peers, timings).
    pub(crate) fn start_with(
        binary: &Path,
        memory: u64,
        extra: &[String],
    ) -> anyhow::Result<Daemon> {
        Daemon::start_env(binary, memory, extra, &[])
    }

    /// [`Daemon::start_with`] with extra environment variables (e.g. `TOKIO_WORKER_THREADS`
    /// for many small daemons on few cores).
    pub(crate) fn start_env(
        binary: &Path,
        memory: u64,
        extra: &[String],
        env: &[(&str, &str)],
    ) -> anyhow::Result<Daemon> {
        if !binary.exists() {
            bail!("{} not found: build it with `cargo build --release -p kvpool-server` or pass --kvpoold", binary.display());
        }
        let dir = scratch_dir("kvpool-bench")?;
        let memory = format!("{}MiB", memory >> 20);
        let child = Command::new(binary)
            .arg("--data-dir")
            .arg(&dir)
            .args([
                "--memory",
                &memory,
                "--tcp",
                "127.0.0.1:0",
                "--quic",
                "127.0.0.1:0",
                "--metrics",
                "127.0.0.1:0",
            ])
            .args(extra)
            .env("KVPOOL_LOG", "warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        register(child.id(), Some(dir.clone()));
        let mut d = Daemon {
            child,
            dir,
            tcp: String::new(),
            quic: String::new(),
            metrics: String::new(),
            loaded: Vec::new(),
        };
        let line = d.ready_line()?;
        for field in line.split_whitespace() {
            if let Some(v) = field.strip_prefix("tcp=") {
                d.tcp = v.to_string();
            } else if let Some(v) = field.strip_prefix("quic=") {
                d.quic = v.to_string();
            } else if let Some(v) = field.strip_prefix("metrics=") {
                d.metrics = v.to_string();
            }
        }
        if d.tcp.is_empty() || d.tcp == "off" {
            bail!("kvpoold ready line has no TCP address: {line:?}");
        }
        Ok(d)
    }

    /// Reads stdout until the ready line (30 s at most), then keeps draining it.
    fn ready_line(&mut self) -> anyhow::Result<String> {
        let stdout = self.child.stdout.take().context("kvpoold stdout")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if !sent && line.starts_with("kvpoold ready") {
                    let _ = tx.send(line);
                    sent = true;
                }
            }
        });
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(line) => Ok(line),
            Err(_) => bail!(
                "kvpoold did not print its ready line within 30 s (exit status: {:?})",
                self.child.try_wait()?
            ),
        }
    }

    /// The exit status once the daemon has exited by itself (a drained node leaves), else None.
    pub(crate) fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The daemon's process id (for its /proc entries).
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL and reap (a crash: nothing of the daemon runs after); the scratch directory
    /// goes when the `Daemon` is dropped.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The self-signed certificate QUIC clients must trust.
    pub(crate) fn cert(&self) -> PathBuf {
        self.dir.join("tls-cert.pem")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        stop(&mut self.child, Duration::from_secs(5));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Child processes alive right now, with their scratch directories, for [`kill_all`].
static CHILDREN: Mutex<Vec<(u32, Option<PathBuf>)>> = Mutex::new(Vec::new());

/// Records a child so that an interrupted run still stops it.
pub(crate) fn register(pid: u32, dir: Option<PathBuf>) {
    CHILDREN
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((pid, dir));
}

/// For Ctrl-C and SIGTERM: stops every child still registered (SIGTERM, up to 2 s, SIGKILL)
/// and removes their directories. The owners' `Drop` does the same on a normal exit.
pub(crate) fn kill_all() {
    let children = std::mem::take(&mut *CHILDREN.lock().unwrap_or_else(|e| e.into_inner()));
    for (pid, _) in &children {
        // SAFETY: kill(2) on our own children, registered while we held their `Child`.
        unsafe { libc::kill(*pid as i32, libc::SIGTERM) };
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    for (pid, dir) in children {
        let mut status = 0;
        // SAFETY: waitpid on our own child with a valid status pointer.
        while unsafe { libc::waitpid(pid as i32, &mut status, libc::WNOHANG) } == 0
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        // SAFETY: as above; a no-op when it already exited.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        if let Some(d) = dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// SIGTERM, wait up to `grace`, then SIGKILL; always reaps the child.
pub(crate) fn stop(child: &mut Child, grace: Duration) {
    CHILDREN
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|(pid, _)| *pid != child.id());
    if let Ok(Some(_)) = child.try_wait() {
        // Already reaped (killed, or it left by itself): its pid may be another process's by then.
        return;
    }
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill(2) on our own child's pid; it is not reaped yet, so the pid is still ours.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A fresh directory under /dev/shm (tmpfs, like the daemon's default), or the temp dir.
pub(crate) fn scratch_dir(prefix: &str) -> anyhow::Result<PathBuf> {
    let base = Path::new("/dev/shm");
    let base = if base.is_dir() {
        base.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = base.join(format!("{prefix}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// The default daemon binary: `kvpoold` next to this executable.
pub(crate) fn default_binary() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("kvpoold")))
        .unwrap_or_else(|| PathBuf::from("kvpoold"))
}
