//! A single-member etcd on loopback ports for the etcd half of the run (Debian's
//! `etcd-server`), its data under the run's scratch directory; stopped when dropped, and on
//! Ctrl-C with the daemons.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::perf::daemon;

/// A running etcd.
pub(crate) struct Etcd {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Etcd {
    /// Starts `bin` on free ports with its data in `dir`, and waits (30 s at most) until it
    /// answers `/health`.
    pub(crate) fn start(bin: &Path, dir: PathBuf) -> anyhow::Result<Etcd> {
        let (client, peer) = (free_port()?, free_port()?);
        let clients = format!("http://127.0.0.1:{client}");
        let peers = format!("http://127.0.0.1:{peer}");
        std::fs::create_dir_all(&dir)?;
        let log = std::fs::File::create(dir.join("etcd.log"))?;
        let child = Command::new(bin)
            .args(["--name", "kvpool-scale"])
            .arg("--data-dir")
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &clients])
            .args(["--advertise-client-urls", &clients])
            .args(["--listen-peer-urls", &peers])
            .args(["--initial-advertise-peer-urls", &peers])
            .args(["--initial-cluster", &format!("kvpool-scale={peers}")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        daemon::register(child.id(), None);
        let e = Etcd {
            child,
            port: client,
            dir,
        };
        let t = Instant::now();
        while !e
            .get("/health")
            .is_ok_and(|b| b.contains("\"health\":\"true\""))
        {
            if t.elapsed() > Duration::from_secs(30) {
                let log = std::fs::read_to_string(e.dir.join("etcd.log")).unwrap_or_default();
                bail!("etcd did not become healthy in 30 s:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(e)
    }

    /// Its client URL.
    pub(crate) fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The process id (for its /proc entries).
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The body of a GET of `path` on the client port.
    pub(crate) fn get(&self, path: &str) -> anyhow::Result<String> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out
            .split_once("\r\n\r\n")
            .map_or("", |(_, b)| b)
            .to_string())
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        daemon::stop(&mut self.child, Duration::from_secs(2));
    }
}

/// The `etcd` binary: `explicit`, else on PATH, else where Debian's `etcd-server` puts it.
pub(crate) fn find(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_path_buf());
    }
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain([PathBuf::from("/usr/bin")])
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
