//! Prometheus metrics: operation counts and latency histograms per operation type, connections,
//! bytes, and the pool's own occupancy and counters, in the text exposition format, served over
//! plain HTTP on `GET /metrics`. Per-namespace series name the tenants, so they are shown only
//! as `listen.metrics_namespaces` allows.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool::Pool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::admission::AcceptErrors;
use crate::config::NamespaceMetrics;

/// Operation types, as labelled in the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// Handshake.
    Hello,
    /// Put.
    Put,
    /// Get.
    Get,
    /// Batch put.
    BatchPut,
    /// Batch get.
    BatchGet,
    /// Exists / batch exists.
    Exists,
    /// Remove.
    Remove,
    /// Alloc.
    Alloc,
    /// One-sided write.
    Write,
    /// Commit.
    Commit,
    /// Abort.
    Abort,
    /// One-sided read.
    Read,
    /// Lookup (lease).
    Lookup,
    /// Release.
    Release,
    /// Pin / unpin.
    Pin,
    /// Stats, view, map info.
    Admin,
}

const OPS: [(OpKind, &str); 16] = [
    (OpKind::Hello, "hello"),
    (OpKind::Put, "put"),
    (OpKind::Get, "get"),
    (OpKind::BatchPut, "batch_put"),
    (OpKind::BatchGet, "batch_get"),
    (OpKind::Exists, "exists"),
    (OpKind::Remove, "remove"),
    (OpKind::Alloc, "alloc"),
    (OpKind::Write, "write"),
    (OpKind::Commit, "commit"),
    (OpKind::Abort, "abort"),
    (OpKind::Read, "read"),
    (OpKind::Lookup, "lookup"),
    (OpKind::Release, "release"),
    (OpKind::Pin, "pin"),
    (OpKind::Admin, "admin"),
];

/// Latency bucket upper bounds: 2^k microseconds, k = 0..24 (1 µs .. 16 s), then +Inf.
const BUCKETS: usize = 25;

#[derive(Default)]
struct OpStats {
    ok: AtomicU64,
    err: AtomicU64,
    sum_us: AtomicU64,
    buckets: [AtomicU64; BUCKETS],
}

/// Transports, as labelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// TCP.
    Tcp,
    /// A QUIC stream.
    Quic,
    /// The Unix socket.
    Unix,
}

impl Transport {
    fn index(self) -> usize {
        self as usize
    }

    /// Label value.
    pub fn name(self) -> &'static str {
        ["tcp", "quic", "unix"][self.index()]
    }
}

/// The daemon's counters.
#[derive(Default)]
pub struct Metrics {
    ops: [OpStats; OPS.len()],
    connections: [AtomicI64; 3],
    connections_total: [AtomicU64; 3],
    protocol_errors: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
}

impl Metrics {
    /// Records one operation.
    pub fn record(&self, op: OpKind, elapsed: Duration, ok: bool) {
        let s = &self.ops[OPS
            .iter()
            .position(|(k, _)| *k == op)
            .expect("every op is listed")];
        if ok { &s.ok } else { &s.err }.fetch_add(1, Ordering::Relaxed);
        let us = elapsed.as_micros().min(u64::MAX as u128) as u64;
        s.sum_us.fetch_add(us, Ordering::Relaxed);
        let bucket = (64 - us.max(1).saturating_sub(1).leading_zeros() as usize).min(BUCKETS - 1);
        s.buckets[bucket].fetch_add(1, Ordering::Relaxed);
    }

    /// A connection (or QUIC stream) opened.
    pub fn connection_opened(&self, t: Transport) {
        self.connections[t.index()].fetch_add(1, Ordering::Relaxed);
        self.connections_total[t.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// A connection closed.
    pub fn connection_closed(&self, t: Transport) {
        self.connections[t.index()].fetch_sub(1, Ordering::Relaxed);
    }

    /// A frame broke the protocol.
    pub fn protocol_error(&self) {
        self.protocol_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Payload bytes received and sent.
    pub fn bytes(&self, read: u64, written: u64) {
        self.bytes_in.fetch_add(read, Ordering::Relaxed);
        self.bytes_out.fetch_add(written, Ordering::Relaxed);
    }

    /// The exposition text; the per-namespace series only with `namespaces`.
    pub fn render(&self, pool: &Pool, namespaces: bool) -> String {
        let mut o = String::with_capacity(8192);
        let st = pool.stats();
        let node = st.node;
        let family = |o: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        family(&mut o, "kvpool_objects", "gauge", "Committed objects.");
        let _ = writeln!(o, "kvpool_objects{{node=\"{node}\"}} {}", st.objects);
        family(
            &mut o,
            "kvpool_pending_allocations",
            "gauge",
            "Allocations not yet committed.",
        );
        let _ = writeln!(
            o,
            "kvpool_pending_allocations{{node=\"{node}\"}} {}",
            st.pending
        );
        for (name, help, v) in [
            (
                "kvpool_hits_total",
                "Lookups that found their object.",
                st.hits,
            ),
            ("kvpool_misses_total", "Lookups that did not.", st.misses),
            (
                "kvpool_evictions_total",
                "Objects evicted for space.",
                st.evictions,
            ),
            ("kvpool_commits_total", "Objects committed.", st.commits),
            (
                "kvpool_reaped_total",
                "Abandoned allocations reclaimed.",
                st.reaped,
            ),
        ] {
            family(&mut o, name, "counter", help);
            let _ = writeln!(o, "{name}{{node=\"{node}\"}} {v}");
        }
        family(
            &mut o,
            "kvpool_segment_bytes",
            "gauge",
            "Segment bytes by state (used, free, capacity).",
        );
        for s in &st.segments {
            for (state, v) in [
                ("capacity", s.capacity),
                ("used", s.used_bytes),
                ("free", s.free_bytes),
            ] {
                let _ = writeln!(
                    o,
                    "kvpool_segment_bytes{{node=\"{node}\",segment=\"{}\",state=\"{state}\"}} {v}",
                    s.id
                );
            }
        }
        family(
            &mut o,
            "kvpool_segment_fragmentation",
            "gauge",
            "1 - largest free run / free bytes.",
        );
        for s in &st.segments {
            let _ = writeln!(
                o,
                "kvpool_segment_fragmentation{{node=\"{node}\",segment=\"{}\"}} {:.4}",
                s.id, s.external_fragmentation
            );
        }
        if namespaces {
            family(
                &mut o,
                "kvpool_namespace_bytes",
                "gauge",
                "Namespace bytes by kind (used, pinned, quota).",
            );
            family(
                &mut o,
                "kvpool_namespace_objects",
                "gauge",
                "Committed objects per namespace.",
            );
        }
        for n in st.namespaces.iter().filter(|_| namespaces) {
            let ns = escape(&n.name);
            for (kind, v) in [
                ("used", n.used_bytes),
                ("pinned", n.pinned_bytes),
                ("quota", n.quota_bytes),
            ] {
                if kind == "quota" && v == u64::MAX {
                    continue;
                }
                let _ = writeln!(o, "kvpool_namespace_bytes{{node=\"{node}\",namespace=\"{ns}\",kind=\"{kind}\"}} {v}");
            }
            let _ = writeln!(
                o,
                "kvpool_namespace_objects{{node=\"{node}\",namespace=\"{ns}\"}} {}",
                n.objects
            );
        }
        family(
            &mut o,
            "kvpool_connections",
            "gauge",
            "Open connections by transport.",
        );
        family(
            &mut o,
            "kvpool_connections_total",
            "counter",
            "Connections accepted by transport.",
        );
        for t in [Transport::Tcp, Transport::Quic, Transport::Unix] {
            let _ = writeln!(
                o,
                "kvpool_connections{{transport=\"{}\"}} {}",
                t.name(),
                self.connections[t.index()].load(Ordering::Relaxed)
            );
            let _ = writeln!(
                o,
                "kvpool_connections_total{{transport=\"{}\"}} {}",
                t.name(),
                self.connections_total[t.index()].load(Ordering::Relaxed)
            );
        }
        family(
            &mut o,
            "kvpool_protocol_errors_total",
            "counter",
            "Frames that broke the protocol.",
        );
        let _ = writeln!(
            o,
            "kvpool_protocol_errors_total {}",
            self.protocol_errors.load(Ordering::Relaxed)
        );
        family(
            &mut o,
            "kvpool_payload_bytes_total",
            "counter",
            "Payload bytes by direction.",
        );
        let _ = writeln!(
            o,
            "kvpool_payload_bytes_total{{direction=\"in\"}} {}",
            self.bytes_in.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            o,
            "kvpool_payload_bytes_total{{direction=\"out\"}} {}",
            self.bytes_out.load(Ordering::Relaxed)
        );
        family(
            &mut o,
            "kvpool_operations_total",
            "counter",
            "Operations by type and outcome.",
        );
        for (i, (_, name)) in OPS.iter().enumerate() {
            let s = &self.ops[i];
            let _ = writeln!(
                o,
                "kvpool_operations_total{{op=\"{name}\",outcome=\"ok\"}} {}",
                s.ok.load(Ordering::Relaxed)
            );
            let _ = writeln!(
                o,
                "kvpool_operations_total{{op=\"{name}\",outcome=\"error\"}} {}",
                s.err.load(Ordering::Relaxed)
            );
        }
        family(
            &mut o,
            "kvpool_operation_seconds",
            "histogram",
            "Operation latency inside the daemon.",
        );
        for (i, (_, name)) in OPS.iter().enumerate() {
            let s = &self.ops[i];
            let mut cum = 0;
            for (b, count) in s.buckets.iter().enumerate() {
                cum += count.load(Ordering::Relaxed);
                if b + 1 < BUCKETS {
                    let le = (1u64 << b) as f64 / 1e6;
                    let _ = writeln!(
                        o,
                        "kvpool_operation_seconds_bucket{{op=\"{name}\",le=\"{le}\"}} {cum}"
                    );
                }
            }
            let _ = writeln!(
                o,
                "kvpool_operation_seconds_bucket{{op=\"{name}\",le=\"+Inf\"}} {cum}"
            );
            let _ = writeln!(
                o,
                "kvpool_operation_seconds_sum{{op=\"{name}\"}} {}",
                s.sum_us.load(Ordering::Relaxed) as f64 / 1e6
            );
            let _ = writeln!(o, "kvpool_operation_seconds_count{{op=\"{name}\"}} {cum}");
        }
        o
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Most scrapes served at once; more wait in the listen backlog.
const MAX_SCRAPES: usize = 16;

/// Serves `GET /metrics` until `shutdown` resolves. Anything else gets 404; requests are read
/// into a small fixed buffer and connections are closed after one response. Per-namespace
/// series are shown as `namespaces` says (`Token`: to a request bearing `token`, or to all when
/// the node has none). A failed accept pauses the loop rather than spinning.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    pool: Arc<Pool>,
    namespaces: NamespaceMetrics,
    token: String,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let scrapes = Arc::new(Semaphore::new(MAX_SCRAPES));
    let token: Arc<str> = token.into();
    let mut errors = AcceptErrors::default();
    loop {
        let permit = tokio::select! {
            p = scrapes.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return,
            },
            _ = &mut shutdown => return,
        };
        let (mut sock, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => {
                    errors.succeeded();
                    s
                }
                Err(e) => {
                    let pause = errors.failed(&e, "metrics", Instant::now());
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => continue,
                        _ = &mut shutdown => return,
                    }
                }
            },
            _ = &mut shutdown => return,
        };
        let metrics = metrics.clone();
        let pool = pool.clone();
        let token = token.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let mut buf = [0u8; 4096];
            let mut n = 0;
            let read = async {
                while n < buf.len() {
                    let m = sock.read(&mut buf[n..]).await?;
                    if m == 0 {
                        break;
                    }
                    n += m;
                    if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                std::io::Result::Ok(())
            };
            if tokio::time::timeout(Duration::from_secs(5), read)
                .await
                .is_err()
            {
                return;
            }
            let req = String::from_utf8_lossy(&buf[..n]);
            let (status, ctype, body) =
                if req.starts_with("GET /metrics ") || req.starts_with("GET /metrics?") {
                    let show = match namespaces {
                        NamespaceMetrics::Off => false,
                        NamespaceMetrics::Open => true,
                        NamespaceMetrics::Token => token.is_empty() || bears(&req, &token),
                    };
                    let body = metrics.render(&pool, show);
                    ("200 OK", "text/plain; version=0.0.4", body)
                } else if req.starts_with("GET /health ") {
                    ("200 OK", "text/plain", "ok\n".to_string())
                } else {
                    ("404 Not Found", "text/plain", "try /metrics\n".to_string())
                };
            let head = format!("HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}

/// Whether the request head carries `Authorization: Bearer <token>`.
fn bears(head: &str, token: &str) -> bool {
    head.lines().skip(1).any(|line| {
        let Some((name, value)) = line.split_once(':') else {
            return false;
        };
        let mut v = value.trim().splitn(2, ' ');
        name.trim().eq_ignore_ascii_case("authorization")
            && v.next().is_some_and(|s| s.eq_ignore_ascii_case("bearer"))
            && v.next().map(str::trim) == Some(token)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_bearer_token_is_accepted() {
        let get = |h: &str| format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{h}\r\n\r\n");
        assert!(bears(&get("Authorization: Bearer s3cret"), "s3cret"));
        assert!(bears(&get("authorization:bearer  s3cret "), "s3cret"));
        assert!(!bears(&get("Authorization: Bearer s3cre"), "s3cret"));
        assert!(!bears(&get("Authorization: Basic s3cret"), "s3cret"));
        assert!(!bears(&get("X-Token: s3cret"), "s3cret"));
        assert!(!bears(
            "GET /metrics?Authorization: Bearer s3cret HTTP/1.1\r\n\r\n",
            "s3cret"
        ));
    }
}
