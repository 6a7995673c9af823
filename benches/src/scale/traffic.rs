//! The coordination traffic of an idle pool, per node per second: what each `kvpoold`'s TCP
//! sockets sent and received (per-process socket statistics from `ss -tinp`, iproute2: bytes
//! and data segments; an idle node's only traffic is its peers' or etcd's), the heartbeats it
//! answered (its `kvpool_operations_total{op="admin"}`, which counts `Heartbeat` and `Gossip`),
//! and, with etcd, what etcd itself counts of its clients
//! (`etcd_network_client_grpc_*_bytes_total`, `grpc_server_msg_*_total`). Nothing else talks to
//! the nodes during the window: the metrics pages are read before it opens and after it
//! closes, outside the socket readings. A socket opened in the window counts from its opening;
//! one closed in it is missed, so how many were is reported.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::soak::sample::{metric, scrape};

use super::etcd::Etcd;
use super::fleet::Fleet;

/// Per node per second, averaged over the live nodes.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Traffic {
    /// TCP bytes sent + received.
    pub(crate) bytes: f64,
    /// TCP data segments sent + received.
    pub(crate) segments: f64,
    /// Established TCP sockets per node (at the window's end).
    pub(crate) sockets: f64,
    /// Sockets of the nodes closed during the window (their bytes are missed).
    pub(crate) closed: usize,
    /// CPU time of the node (user + system), seconds per second.
    pub(crate) cpu: f64,
    /// Heartbeats (and gossip) answered.
    pub(crate) heartbeats_in: f64,
    /// etcd's client bytes (received + sent) and messages, divided by the nodes (0 without).
    pub(crate) etcd_bytes: f64,
    pub(crate) etcd_messages: f64,
}

/// Per socket of the processes `pids` ((pid, local, peer) → counts): bytes sent, bytes
/// received, data segments out, data segments in.
type Sockets = HashMap<(u32, String, String), [u64; 4]>;

/// `ss -tinpH state established`, parsed for the sockets of `pids`.
fn sockets(pids: &HashSet<u32>) -> anyhow::Result<Sockets> {
    let out = std::process::Command::new("ss")
        .args(["-tinpH", "state", "established"])
        .output()
        .context("running ss (iproute2)")?;
    if !out.status.success() {
        bail!("ss failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut map = Sockets::new();
    let mut current: Option<(u32, String, String)> = None;
    for line in text.lines() {
        if !line.starts_with(char::is_whitespace) {
            // "Recv-Q Send-Q local peer users:((\"name\",pid=N,fd=M))"
            let f: Vec<&str> = line.split_whitespace().collect();
            let pid = line
                .split_once("pid=")
                .and_then(|(_, r)| r.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|p| p.parse().ok());
            current = match (pid, f.get(2), f.get(3)) {
                (Some(pid), Some(l), Some(p)) if pids.contains(&pid) => {
                    Some((pid, l.to_string(), p.to_string()))
                }
                _ => None,
            };
            continue;
        }
        let Some(key) = current.take() else { continue };
        let field = |name: &str| -> u64 {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name)?.parse().ok())
                .unwrap_or(0)
        };
        let sent = match field("bytes_sent:") {
            0 => field("bytes_acked:"),
            n => n,
        };
        let counts = [
            sent,
            field("bytes_received:"),
            field("data_segs_out:"),
            field("data_segs_in:"),
        ];
        map.insert(key, counts);
    }
    Ok(map)
}

/// CPU time of process `pid` so far (utime + stime of `/proc/<pid>/stat`), in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at the state, field 3.
    let rest = text.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|x| x.parse().ok())
        .collect();
    f.iter().sum()
}

fn heartbeats(m: &HashMap<String, f64>) -> f64 {
    metric(m, "kvpool_operations_total", "op=\"admin\"")
}

fn etcd_counts(e: &Etcd) -> (f64, f64) {
    let Ok(m) = scrape(&e.url().replace("http://", "")) else {
        return (0.0, 0.0);
    };
    let bytes = metric(&m, "etcd_network_client_grpc_received_bytes_total", "")
        + metric(&m, "etcd_network_client_grpc_sent_bytes_total", "");
    let msgs = metric(&m, "grpc_server_msg_received_total", "")
        + metric(&m, "grpc_server_msg_sent_total", "");
    (bytes, msgs)
}

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`).
fn clock_ticks() -> f64 {
    // SAFETY: sysconf reads a constant of the system; no memory is passed.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// Measures the idle pool's traffic over `window`.
pub(crate) async fn measure(
    fleet: &Fleet,
    etcd: Option<&Etcd>,
    window: Duration,
) -> anyhow::Result<Traffic> {
    let live: Vec<(u32, String)> = fleet
        .members
        .iter()
        .filter(|m| m.alive)
        .map(|m| (m.daemon.pid(), m.daemon.metrics.clone()))
        .collect();
    let n = live.len() as f64;
    let page = |addr: &str| scrape(addr).map(|m| heartbeats(&m));
    let mut hb0 = 0.0;
    let s0 = Instant::now();
    for (_, addr) in &live {
        hb0 += page(addr)?;
    }
    let mid0 = s0 + s0.elapsed() / 2;
    let e0 = etcd.map_or((0.0, 0.0), etcd_counts);
    let pids: HashSet<u32> = live.iter().map(|(pid, _)| *pid).collect();
    let ss0 = sockets(&pids)?;
    let cpu0: u64 = pids.iter().map(|&p| cpu_ticks(p)).sum();
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    let cpu1: u64 = pids.iter().map(|&p| cpu_ticks(p)).sum();
    let ss1 = sockets(&pids)?;
    let secs = t0.elapsed().as_secs_f64();
    let e1 = etcd.map_or((0.0, 0.0), etcd_counts);
    let mut hb1 = 0.0;
    let s1 = Instant::now();
    for (_, addr) in &live {
        hb1 += page(addr)?;
    }
    let hb_secs = (s1 + s1.elapsed() / 2).duration_since(mid0).as_secs_f64();
    let (mut bytes, mut segments) = (0u64, 0u64);
    for (key, now) in &ss1 {
        let then = ss0.get(key).copied().unwrap_or_default();
        let d: Vec<u64> = now
            .iter()
            .zip(then)
            .map(|(a, b)| a.saturating_sub(b))
            .collect();
        bytes += d[0] + d[1];
        segments += d[2] + d[3];
    }
    let closed = ss0.keys().filter(|k| !ss1.contains_key(*k)).count();
    let per = |x: f64| x / n / secs;
    Ok(Traffic {
        bytes: per(bytes as f64),
        segments: per(segments as f64),
        cpu: per(cpu1.saturating_sub(cpu0) as f64) / clock_ticks(),
        sockets: ss1.len() as f64 / n,
        closed,
        // Between the middles of the two rounds of scrapes (a metrics page is HTTP, not an
        // operation, so the counter saw the heartbeats alone).
        heartbeats_in: (hb1 - hb0) / n / hb_secs,
        etcd_bytes: per(e1.0 - e0.0),
        etcd_messages: per(e1.1 - e0.1),
    })
}
