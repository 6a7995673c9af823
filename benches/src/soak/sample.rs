//! Samples of the daemon (its RSS, open descriptors and Prometheus gauges) and of the load,
//! and what a finished run observed.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;

use super::ops::Stats;
use super::SoakArgs;

/// One sample of the daemon and the load.
#[derive(Clone, Debug)]
pub(super) struct Sample {
    pub(super) t_s: f64,
    pub(super) rss: u64,
    pub(super) rss_anon: u64,
    pub(super) fds: u64,
    pub(super) pending: f64,
    pub(super) connections: f64,
    pub(super) objects: f64,
    pub(super) used: f64,
    pub(super) evictions: f64,
    pub(super) reaped: f64,
    pub(super) ops: u64,
    pub(super) ops_s: f64,
    pub(super) hits: u64,
    pub(super) misses: u64,
    pub(super) wrong: u64,
    pub(super) errors: u64,
}

impl Sample {
    pub(super) fn json(&self) -> serde_json::Value {
        json!({
            "t_s": self.t_s,
            "rss_bytes": self.rss,
            "rss_anon_bytes": self.rss_anon,
            "fds": self.fds,
            "pending_allocations": self.pending,
            "connections": self.connections,
            "objects": self.objects,
            "used_bytes": self.used,
            "evictions": self.evictions,
            "reaped": self.reaped,
            "ops": self.ops,
            "ops_per_s": self.ops_s,
            "hits": self.hits,
            "misses": self.misses,
            "wrong": self.wrong,
            "errors": self.errors,
        })
    }
}

/// A field of /proc/PID/status, in bytes.
fn proc_status(pid: u32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    text.lines()
        .find_map(|l| {
            let rest = l.strip_prefix(field)?.strip_prefix(':')?;
            rest.split_whitespace().next()?.parse::<u64>().ok()
        })
        .map_or(0, |kib| kib << 10)
}

fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64)
}

/// The daemon's /metrics, as series (`name{labels}`) to values.
pub(crate) fn scrape(addr: &str) -> anyhow::Result<HashMap<String, f64>> {
    let mut s = std::net::TcpStream::connect(addr).with_context(|| format!("metrics at {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut body = String::new();
    s.read_to_string(&mut body)?;
    let (_, body) = body.split_once("\r\n\r\n").context("no HTTP body")?;
    Ok(body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect())
}

/// Sum of the series of metric `name` whose labels contain `label` (empty: all).
pub(crate) fn metric(m: &HashMap<String, f64>, name: &str, label: &str) -> f64 {
    m.iter()
        .filter(|(series, _)| {
            let (n, labels) = series.split_once('{').unwrap_or((series, ""));
            n == name && labels.contains(label)
        })
        .map(|(_, v)| v)
        .sum()
}

/// Sample-taking state.
pub(super) struct Sampler {
    pub(super) pid: u32,
    pub(super) metrics: String,
    pub(super) began: Instant,
    pub(super) last: Option<(Instant, u64)>,
}

impl Sampler {
    pub(super) fn take(&mut self, stats: &Stats) -> anyhow::Result<Sample> {
        let m = scrape(&self.metrics)?;
        let now = Instant::now();
        let ops = stats.total_ops();
        let ops_s = match self.last {
            Some((t, n)) => (ops - n) as f64 / now.duration_since(t).as_secs_f64(),
            None => 0.0,
        };
        self.last = Some((now, ops));
        Ok(Sample {
            t_s: now.duration_since(self.began).as_secs_f64(),
            rss: proc_status(self.pid, "VmRSS"),
            rss_anon: proc_status(self.pid, "RssAnon"),
            fds: open_fds(self.pid),
            pending: metric(&m, "kvpool_pending_allocations", ""),
            connections: metric(&m, "kvpool_connections", ""),
            objects: metric(&m, "kvpool_objects", ""),
            used: metric(&m, "kvpool_segment_bytes", "state=\"used\""),
            evictions: metric(&m, "kvpool_evictions_total", ""),
            reaped: metric(&m, "kvpool_reaped_total", ""),
            ops,
            ops_s,
            hits: stats.hits.load(Relaxed),
            misses: stats.misses.load(Relaxed),
            wrong: stats.wrong.load(Relaxed),
            errors: stats.total_errors(),
        })
    }
}

/// What a finished run observed.
pub(super) struct Observed<'a> {
    pub(super) args: &'a SoakArgs,
    pub(super) duration: Duration,
    pub(super) samples: Vec<Sample>,
    /// The last sample, once the load stopped and the pending allocations drained (or the
    /// drain's deadline passed).
    pub(super) after: Sample,
    /// Seconds from stopping the load to `after`.
    pub(super) drained_s: f64,
    pub(super) stats: &'a Stats,
    pub(super) local_paths: usize,
    pub(super) keys: u64,
}

/// Samples every `every` from the start of `sampler` for `duration`, printing each sample.
pub(super) fn sample_until(
    sampler: &mut Sampler,
    stats: &Stats,
    duration: Duration,
    every: Duration,
) -> anyhow::Result<Vec<Sample>> {
    let n = (duration.as_secs_f64() / every.as_secs_f64()).floor() as u32;
    let mut samples = Vec::new();
    for k in 0..=n {
        let at = sampler.began + every * k;
        std::thread::sleep(at.saturating_duration_since(Instant::now()));
        let s = sampler.take(stats)?;
        eprintln!(
            "  t={:>5.0}s  rss {:>10}  fds {:>4}  pending {:>5}  ops/s {:>8.0}  wrong {}",
            s.t_s,
            mib(s.rss as f64),
            s.fds,
            s.pending,
            s.ops_s,
            s.wrong
        );
        samples.push(s);
    }
    Ok(samples)
}

pub(super) fn mib(b: f64) -> String {
    format!("{:.1} MiB", b / 1048576.0)
}
