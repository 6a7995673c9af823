//! Prometheus metrics: operation counts and latency histograms per operation type, connections,
//! bytes, and the pool's own occupancy and counters, in the OpenMetrics text format (encoded by
//! `prometheus-client`), served over plain HTTP on `GET /metrics`. Per-namespace series name the tenants, so they are shown only
//! as `listen.metrics_namespaces` allows.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool::pool::PoolStats;
use kvpool::Pool;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::text;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
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
    /// Prefix scan (one page).
    Scan,
    /// Stats, view, map info.
    Admin,
}

const OPS: [(OpKind, &str); 17] = [
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
    (OpKind::Scan, "scan"),
    (OpKind::Admin, "admin"),
];

/// Latency bucket upper bounds: 2^k microseconds, k = 0..24 (1 µs .. 8 s), then +Inf.
const BUCKETS: usize = 25;

/// One operation type: outcome counters and a latency histogram kept in plain atomics (the
/// client library's own histogram takes a lock per observation).
#[derive(Debug, Default)]
struct OpStats {
    ok: Counter,
    err: Counter,
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
    /// The Redis-protocol front door (`listen.resp`).
    Resp,
    /// TCP with TLS (`listen.tls`).
    Tls,
}

impl Transport {
    fn index(self) -> usize {
        self as usize
    }

    /// Label value.
    pub fn name(self) -> &'static str {
        ["tcp", "quic", "unix", "resp", "tls"][self.index()]
    }
}

const TRANSPORTS: [Transport; 5] = [
    Transport::Tcp,
    Transport::Quic,
    Transport::Unix,
    Transport::Resp,
    Transport::Tls,
];

/// The commands of the Redis-protocol front door, as labelled (`other`: any command it does not
/// serve).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RespCommand {
    /// PING.
    Ping,
    /// ECHO.
    Echo,
    /// HELLO.
    Hello,
    /// AUTH.
    Auth,
    /// SELECT.
    Select,
    /// QUIT.
    Quit,
    /// GET.
    Get,
    /// SET.
    Set,
    /// MGET.
    Mget,
    /// MSET.
    Mset,
    /// EXISTS.
    Exists,
    /// DEL.
    Del,
    /// UNLINK.
    Unlink,
    /// STRLEN.
    Strlen,
    /// SCAN.
    Scan,
    /// DBSIZE.
    Dbsize,
    /// FLUSHDB and FLUSHALL.
    Flushdb,
    /// INFO.
    Info,
    /// CLIENT.
    Client,
    /// CONFIG.
    Config,
    /// COMMAND.
    Command,
    /// Anything else (answered `-ERR unknown command`).
    Other,
}

const RESP_COMMANDS: [(RespCommand, &str); 22] = [
    (RespCommand::Ping, "ping"),
    (RespCommand::Echo, "echo"),
    (RespCommand::Hello, "hello"),
    (RespCommand::Auth, "auth"),
    (RespCommand::Select, "select"),
    (RespCommand::Quit, "quit"),
    (RespCommand::Get, "get"),
    (RespCommand::Set, "set"),
    (RespCommand::Mget, "mget"),
    (RespCommand::Mset, "mset"),
    (RespCommand::Exists, "exists"),
    (RespCommand::Del, "del"),
    (RespCommand::Unlink, "unlink"),
    (RespCommand::Strlen, "strlen"),
    (RespCommand::Scan, "scan"),
    (RespCommand::Dbsize, "dbsize"),
    (RespCommand::Flushdb, "flushdb"),
    (RespCommand::Info, "info"),
    (RespCommand::Client, "client"),
    (RespCommand::Config, "config"),
    (RespCommand::Command, "command"),
    (RespCommand::Other, "other"),
];

impl RespCommand {
    /// The command named `upper` (an upper-case command name; the hot path of every RESP
    /// command, so a `match` rather than a search of the label table).
    pub fn from_name(upper: &[u8]) -> RespCommand {
        use RespCommand as C;
        match upper {
            b"GET" => C::Get,
            b"SET" => C::Set,
            b"MGET" => C::Mget,
            b"MSET" => C::Mset,
            b"EXISTS" => C::Exists,
            b"DEL" => C::Del,
            b"UNLINK" => C::Unlink,
            b"STRLEN" => C::Strlen,
            b"SCAN" => C::Scan,
            b"PING" => C::Ping,
            b"ECHO" => C::Echo,
            b"HELLO" => C::Hello,
            b"AUTH" => C::Auth,
            b"SELECT" => C::Select,
            b"QUIT" => C::Quit,
            b"DBSIZE" => C::Dbsize,
            b"FLUSHDB" | b"FLUSHALL" => C::Flushdb,
            b"INFO" => C::Info,
            b"CLIENT" => C::Client,
            b"CONFIG" => C::Config,
            b"COMMAND" => C::Command,
            _ => C::Other,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

pub(crate) use crate::ledger::Limit;
use crate::ledger::{Ledger, RESOURCES};

/// Why an unauthenticated connection was closed to admit a new one, as labelled on
/// `kvpool_connections_reaped`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReapCause {
    /// The node was at `listen.max_connections`.
    MaxConnections,
    /// An accept failed for lack of descriptors (`EMFILE`, `ENFILE`).
    Descriptors,
}

const REAP_CAUSES: [(ReapCause, &str); 2] = [
    (ReapCause::MaxConnections, "max_connections"),
    (ReapCause::Descriptors, "descriptors"),
];

/// The daemon's own series: every one a lock-free atomic, indexed by its labels.
#[derive(Debug, Default)]
struct Daemon {
    ops: [OpStats; OPS.len()],
    connections: [Gauge; TRANSPORTS.len()],
    connections_accepted: [Counter; TRANSPORTS.len()],
    protocol_errors: Counter,
    resp_commands: [Counter; RESP_COMMANDS.len()],
    resp_errors: [Counter; RESP_COMMANDS.len()],
    resp_protocol_errors: Counter,
    resp_input_refusals: Counter,
    auth_failures: Counter,
    auth_throttled: Counter,
    cluster_auth_failures: Counter,
    cluster_auth_throttled: Counter,
    /// Unauthenticated connections closed to admit new ones, by cause.
    reaped: [Counter; REAP_CAUSES.len()],
    /// Requests and connections refused by a limit, by limit.
    limit_refusals: [Counter; Limit::ALL.len()],
    bytes_in: Counter,
    bytes_out: Counter,
    /// Bulk chunks and their bytes by priority (Background .. High).
    bulk_chunks: [Counter; 4],
    bulk_bytes: [Counter; 4],
    /// Bulk requests refused because their deadline could not be met.
    bulk_refused: Counter,
    /// Unpinned objects handed to their new owner after a view change, and their bytes.
    handover_objects: Counter,
    handover_bytes: Counter,
    /// Copies here dropped without sending: the new owner already held the key, or refused
    /// the copy because it has a newer value or remove.
    handover_dropped: Counter,
    /// Objects the last handover pass left here for a later one.
    handover_pending: Gauge,
    /// Bytes of the staging areas handed to same-host writers now.
    staging_bytes: Gauge,
}

/// The daemon's counters.
#[derive(Default)]
pub struct Metrics {
    daemon: Arc<Daemon>,
}

impl Metrics {
    /// One bulk chunk of `bytes` moved in its turn at `priority`.
    pub fn bulk_chunk(&self, priority: kvpool::protocol::Priority, bytes: u64) {
        let i = priority as usize;
        self.daemon.bulk_chunks[i].inc();
        self.daemon.bulk_bytes[i].inc_by(bytes);
    }

    /// A bulk request refused up front: its deadline could not be met.
    pub fn bulk_refused(&self) {
        self.daemon.bulk_refused.inc();
    }

    /// One handover pass: the objects (and bytes) now held by their new owners, the copies
    /// given up without sending, and those kept here for a later pass.
    pub(crate) fn handover_pass(&self, handed: u64, bytes: u64, dropped: u64, kept: u64) {
        let d = &self.daemon;
        d.handover_objects.inc_by(handed);
        d.handover_bytes.inc_by(bytes);
        d.handover_dropped.inc_by(dropped);
        d.handover_pending.set(kept.min(i64::MAX as u64) as i64);
    }

    /// Records one operation.
    pub fn record(&self, op: OpKind, elapsed: Duration, ok: bool) {
        let s = &self.daemon.ops[OPS
            .iter()
            .position(|(k, _)| *k == op)
            .expect("every op is listed")];
        if ok { &s.ok } else { &s.err }.inc();
        let us = elapsed.as_micros().min(u64::MAX as u128) as u64;
        s.sum_us.fetch_add(us, Ordering::Relaxed);
        let bucket = (64 - us.max(1).saturating_sub(1).leading_zeros() as usize).min(BUCKETS - 1);
        s.buckets[bucket].fetch_add(1, Ordering::Relaxed);
    }

    /// A connection (or QUIC stream) opened.
    pub fn connection_opened(&self, t: Transport) {
        self.daemon.connections[t.index()].inc();
        self.daemon.connections_accepted[t.index()].inc();
    }

    /// A connection closed.
    pub fn connection_closed(&self, t: Transport) {
        self.daemon.connections[t.index()].dec();
    }

    /// A frame broke the protocol.
    pub fn protocol_error(&self) {
        self.daemon.protocol_errors.inc();
    }

    /// A command of the RESP front door, answered with an error reply when `failed`.
    pub fn resp_command(&self, c: RespCommand, failed: bool) {
        self.daemon.resp_commands[c.index()].inc();
        if failed {
            self.daemon.resp_errors[c.index()].inc();
        }
    }

    /// Bytes on the RESP front door that were not RESP (the connection was closed).
    pub fn resp_protocol_error(&self) {
        self.daemon.resp_protocol_errors.inc();
    }

    /// A peer presented a wrong token.
    pub fn auth_failed(&self) {
        self.daemon.auth_failures.inc();
    }

    /// A peer's authentication refused unchecked: it failed too often.
    pub fn auth_throttled(&self) {
        self.daemon.auth_throttled.inc();
    }

    /// A peer presented a wrong proof of the cluster secret.
    pub fn cluster_auth_failed(&self) {
        self.daemon.cluster_auth_failures.inc();
    }

    /// A peer's proof of the cluster secret refused unchecked: the node's budget of failed
    /// proofs was spent and the peer had failed recently.
    pub fn cluster_auth_throttled(&self) {
        self.daemon.cluster_auth_throttled.inc();
    }

    /// An unauthenticated connection closed to admit a new one.
    pub fn connection_reaped(&self, cause: ReapCause) {
        self.daemon.reaped[cause as usize].inc();
    }

    /// The gauge of the bytes of staging areas handed out, for the areas' registry to keep.
    pub(crate) fn staging_gauge(&self) -> Gauge {
        self.daemon.staging_bytes.clone()
    }

    /// A request or connection refused by `limit`.
    pub(crate) fn limit_refused(&self, limit: Limit) {
        self.daemon.limit_refusals[limit as usize].inc();
    }

    /// A RESP connection closed because the door's input buffers were full
    /// (`[resp] input_memory`).
    pub fn resp_input_refused(&self) {
        self.daemon.resp_input_refusals.inc();
    }

    /// Payload bytes received and sent.
    pub fn bytes(&self, read: u64, written: u64) {
        self.daemon.bytes_in.inc_by(read);
        self.daemon.bytes_out.inc_by(written);
    }

    /// The page in the OpenMetrics text format, ending in `# EOF`; the per-namespace series
    /// only with `namespaces`.
    pub(crate) fn render(
        &self,
        pool: &Pool,
        ledger: &Ledger,
        namespaces: bool,
    ) -> Result<String, std::fmt::Error> {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Scrape {
            daemon: self.daemon.clone(),
            resources: RESOURCES.map(|r| (r.name(), ledger.total(r))),
            pool: pool.stats(),
            long_keys: pool.long_keys_refused(),
            huge_regions: pool.segments().map(|s| s.huge_regions()).collect(),
            journal: pool.journal_stats(),
            namespaces,
        }));
        let mut out = String::with_capacity(16 << 10);
        text::encode(&mut out, &registry)?;
        Ok(out)
    }
}

/// One scrape: the daemon's counters and a snapshot of the pool's.
#[derive(Debug)]
struct Scrape {
    daemon: Arc<Daemon>,
    pool: PoolStats,
    /// Keys the pool refused for their length (every door checks keys with the pool's check,
    /// which counts them): the `key_length` series.
    long_keys: u64,
    /// Per segment: its data area's 2 MiB regions collapsed into huge pages, and those the
    /// kernel refused (`Segment::huge_regions`).
    huge_regions: Vec<(u64, u64)>,
    /// The index journal's, when the segments are files (`Pool::journal_stats`).
    journal: Option<kvpool::journal::JournalStats>,
    /// What peers make the node hold, by resource (the ledger's totals).
    resources: [(&'static str, u64); RESOURCES.len()],
    namespaces: bool,
}

/// Writes one metric family: its descriptor, then each series with its labels.
fn family<S: EncodeLabelSet, M: EncodeMetric>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    kind: MetricType,
    series: impl IntoIterator<Item = (S, M)>,
) -> std::fmt::Result {
    let mut family = enc.encode_descriptor(name, help, unit, kind)?;
    for (labels, metric) in series {
        metric.encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// Writes a metric family of one series without labels.
fn single(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    kind: MetricType,
    metric: &impl EncodeMetric,
) -> std::fmt::Result {
    metric.encode(enc.encode_descriptor(name, help, unit, kind)?)
}

fn gauge(v: u64) -> ConstGauge<u64> {
    ConstGauge::new(v)
}

fn counter(v: u64) -> ConstCounter<u64> {
    ConstCounter::new(v)
}

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let node = self.pool.node.to_string();
        self.encode_pool(&mut enc, &node)?;
        self.encode_journal(&mut enc, &node)?;
        if self.namespaces {
            self.encode_namespaces(&mut enc, &node)?;
        }
        self.encode_daemon(&mut enc)?;
        self.encode_latency(&mut enc)
    }
}

impl Scrape {
    /// The pool's objects, counters and segments.
    fn encode_pool(&self, e: &mut DescriptorEncoder, node: &str) -> std::fmt::Result {
        let (st, bytes) = (&self.pool, Some(&Unit::Bytes));
        let (gauge_t, counter_t) = (MetricType::Gauge, MetricType::Counter);
        family(
            e,
            "kvpool_objects",
            "Committed objects.",
            None,
            gauge_t,
            [([("node", node)], gauge(st.objects))],
        )?;
        family(
            e,
            "kvpool_pending_allocations",
            "Allocations not yet committed.",
            None,
            gauge_t,
            [([("node", node)], gauge(st.pending))],
        )?;
        for (name, help, v) in [
            ("kvpool_hits", "Lookups that found their object.", st.hits),
            ("kvpool_misses", "Lookups that did not.", st.misses),
            (
                "kvpool_evictions",
                "Objects evicted for space.",
                st.evictions,
            ),
            ("kvpool_commits", "Objects committed.", st.commits),
            (
                "kvpool_reaped",
                "Abandoned allocations reclaimed.",
                st.reaped,
            ),
        ] {
            family(
                e,
                name,
                help,
                None,
                counter_t,
                [([("node", node)], counter(v))],
            )?;
        }
        let ids: Vec<String> = st.segments.iter().map(|s| s.id.to_string()).collect();
        family(
            e,
            "kvpool_segment",
            "Segment bytes by state (used, free, capacity).",
            bytes,
            gauge_t,
            st.segments.iter().zip(&ids).flat_map(|(s, id)| {
                [
                    ("capacity", s.capacity),
                    ("used", s.used_bytes),
                    ("free", s.free_bytes),
                ]
                .map(|(state, v)| {
                    (
                        [("node", node), ("segment", id), ("state", state)],
                        gauge(v),
                    )
                })
            }),
        )?;
        family(
            e,
            "kvpool_segment_huge_regions",
            "The data area's 2 MiB regions collapsed into huge pages as they were first used \
             (collapsed), and those the kernel did not collapse (refused): docs/ARCHITECTURE.md.",
            None,
            gauge_t,
            self.huge_regions
                .iter()
                .zip(&ids)
                .flat_map(|(&(done, refused), id)| {
                    [("collapsed", done), ("refused", refused)].map(|(state, v)| {
                        (
                            [("node", node), ("segment", id), ("state", state)],
                            gauge(v),
                        )
                    })
                }),
        )?;
        family(
            e,
            "kvpool_segment_fragmentation",
            "1 - largest free run / free bytes.",
            None,
            gauge_t,
            st.segments.iter().zip(&ids).map(|(s, id)| {
                (
                    [("node", node), ("segment", id)],
                    ConstGauge::new(s.external_fragmentation),
                )
            }),
        )
    }

    /// The index journal's state, when there is one (docs/RELIABILITY.md).
    fn encode_journal(&self, e: &mut DescriptorEncoder, node: &str) -> std::fmt::Result {
        let Some(j) = self.journal else {
            return Ok(());
        };
        let labels = [("node", node)];
        for (name, help, unit, v) in [
            (
                "kvpool_journal_healthy",
                "1 while the index journal is written; 0 once a write failed and it was \
                 deleted (the next start will be empty).",
                None,
                u64::from(j.healthy),
            ),
            (
                "kvpool_journal",
                "The index journal's header and records.",
                Some(&Unit::Bytes),
                j.bytes,
            ),
            (
                "kvpool_journal_records",
                "Records in the index journal since it was last written whole.",
                None,
                j.records,
            ),
        ] {
            family(e, name, help, unit, MetricType::Gauge, [(labels, gauge(v))])?;
        }
        for (name, help, v) in [
            (
                "kvpool_journal_compactions",
                "Index journal compactions finished.",
                j.compactions,
            ),
            (
                "kvpool_journal_compaction_failures",
                "Index journal compactions that could not be written (the journal was kept; \
                 they are tried again).",
                j.compaction_failures,
            ),
        ] {
            family(
                e,
                name,
                help,
                None,
                MetricType::Counter,
                [(labels, counter(v))],
            )?;
        }
        Ok(())
    }

    /// Per namespace: bytes by kind and objects.
    fn encode_namespaces(&self, e: &mut DescriptorEncoder, node: &str) -> std::fmt::Result {
        let (st, bytes, gauge_t) = (&self.pool, Some(&Unit::Bytes), MetricType::Gauge);
        family(
            e,
            "kvpool_namespace",
            "Namespace bytes by kind (used, pinned, quota).",
            bytes,
            gauge_t,
            st.namespaces.iter().flat_map(|n| {
                [
                    ("used", n.used_bytes),
                    ("pinned", n.pinned_bytes),
                    ("quota", n.quota_bytes),
                ]
                .into_iter()
                .filter(|&(kind, v)| !(kind == "quota" && v == u64::MAX))
                .map(|(kind, v)| {
                    (
                        [
                            ("node", node),
                            ("namespace", n.name.as_str()),
                            ("kind", kind),
                        ],
                        gauge(v),
                    )
                })
            }),
        )?;
        family(
            e,
            "kvpool_namespace_objects",
            "Committed objects per namespace.",
            None,
            gauge_t,
            st.namespaces.iter().map(|n| {
                (
                    [("node", node), ("namespace", n.name.as_str())],
                    gauge(n.objects),
                )
            }),
        )
    }

    /// The daemon's connections, protocol errors, payload bytes and operations.
    fn encode_daemon(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let (d, bytes) = (&*self.daemon, Some(&Unit::Bytes));
        let (gauge_t, counter_t) = (MetricType::Gauge, MetricType::Counter);
        family(
            e,
            "kvpool_connections",
            "Open connections by transport.",
            None,
            gauge_t,
            TRANSPORTS.map(|t| ([("transport", t.name())], d.connections[t.index()].clone())),
        )?;
        family(
            e,
            "kvpool_connections_accepted",
            "Connections accepted by transport.",
            None,
            counter_t,
            TRANSPORTS.map(|t| {
                (
                    [("transport", t.name())],
                    d.connections_accepted[t.index()].clone(),
                )
            }),
        )?;
        single(
            e,
            "kvpool_protocol_errors",
            "Frames that broke the protocol.",
            None,
            counter_t,
            &d.protocol_errors,
        )?;
        self.encode_resp(e)?;
        family(
            e,
            "kvpool_payload",
            "Payload bytes by direction.",
            bytes,
            counter_t,
            [
                ([("direction", "in")], d.bytes_in.clone()),
                ([("direction", "out")], d.bytes_out.clone()),
            ],
        )?;
        let prios = [
            kvpool::protocol::Priority::Background,
            kvpool::protocol::Priority::Low,
            kvpool::protocol::Priority::Normal,
            kvpool::protocol::Priority::High,
        ];
        family(
            e,
            "kvpool_bulk_chunks",
            "Bulk chunks moved in their turn, by priority.",
            None,
            counter_t,
            prios.map(|p| ([("priority", p.name())], d.bulk_chunks[p as usize].clone())),
        )?;
        family(
            e,
            "kvpool_bulk",
            "Bulk bytes moved in their turn, by priority.",
            bytes,
            counter_t,
            prios.map(|p| ([("priority", p.name())], d.bulk_bytes[p as usize].clone())),
        )?;
        single(
            e,
            "kvpool_bulk_deadline_refusals",
            "Bulk requests refused up front because their deadline could not be met.",
            None,
            counter_t,
            &d.bulk_refused,
        )?;
        single(
            e,
            "kvpool_handover_objects",
            "Unpinned objects handed to their new owner after a view change (drain or join).",
            None,
            counter_t,
            &d.handover_objects,
        )?;
        single(
            e,
            "kvpool_handover",
            "Bytes of the unpinned objects handed to their new owner.",
            bytes,
            counter_t,
            &d.handover_bytes,
        )?;
        single(
            e,
            "kvpool_handover_dropped",
            "Copies dropped without sending: the new owner held the key or a newer value or remove.",
            None,
            counter_t,
            &d.handover_dropped,
        )?;
        single(
            e,
            "kvpool_handover_pending",
            "Objects another node now owns that the last handover pass left here for a later one.",
            None,
            gauge_t,
            &d.handover_pending,
        )?;
        family(
            e,
            "kvpool_operations",
            "Operations by type and outcome.",
            None,
            counter_t,
            OPS.iter().zip(&d.ops).flat_map(|((_, op), s)| {
                [
                    ([("op", *op), ("outcome", "ok")], s.ok.clone()),
                    ([("op", *op), ("outcome", "error")], s.err.clone()),
                ]
            }),
        )
    }

    /// The RESP front door's commands, error replies and protocol errors.
    fn encode_resp(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let d = &*self.daemon;
        let counter_t = MetricType::Counter;
        family(
            e,
            "kvpool_resp_commands",
            "Commands served by the RESP front door, by command.",
            None,
            counter_t,
            RESP_COMMANDS
                .iter()
                .map(|(c, n)| ([("command", *n)], d.resp_commands[c.index()].clone())),
        )?;
        family(
            e,
            "kvpool_resp_command_errors",
            "RESP commands answered with an error reply, by command.",
            None,
            counter_t,
            RESP_COMMANDS
                .iter()
                .map(|(c, n)| ([("command", *n)], d.resp_errors[c.index()].clone())),
        )?;
        single(
            e,
            "kvpool_resp_protocol_errors",
            "RESP connections closed for bytes that were not RESP.",
            None,
            counter_t,
            &d.resp_protocol_errors,
        )?;
        single(
            e,
            "kvpool_resp_input_refusals",
            "RESP connections closed because the door's input buffers were full ([resp] input_memory).",
            None,
            counter_t,
            &d.resp_input_refusals,
        )?;
        single(
            e,
            "kvpool_auth_failures",
            "Wrong tokens presented (Hello, RESP AUTH).",
            None,
            counter_t,
            &d.auth_failures,
        )?;
        single(
            e,
            "kvpool_auth_throttled",
            "Authentications refused unchecked: the peer address failed too often ([limits] auth_failures), or failed recently while the node's budget was spent (auth_failures_per_second).",
            None,
            counter_t,
            &d.auth_throttled,
        )?;
        single(
            e,
            "kvpool_cluster_auth_failures",
            "Wrong proofs of the cluster secret presented (ClusterAuth).",
            None,
            counter_t,
            &d.cluster_auth_failures,
        )?;
        single(
            e,
            "kvpool_cluster_auth_throttled",
            "Proofs of the cluster secret refused unchecked: the peer address failed recently while the node's budget was spent ([limits] cluster_auth_failures_per_second).",
            None,
            counter_t,
            &d.cluster_auth_throttled,
        )?;
        family(
            e,
            "kvpool_connections_reaped",
            "Unauthenticated connections closed to admit a new connection, by cause.",
            None,
            counter_t,
            REAP_CAUSES.map(|(c, n)| ([("cause", n)], d.reaped[c as usize].clone())),
        )?;
        single(
            e,
            "kvpool_staging",
            "Bytes of the staging areas handed to same-host writers of read-only segments (memory.same_host_writes).",
            Some(&Unit::Bytes),
            MetricType::Gauge,
            &d.staging_bytes,
        )?;
        family(
            e,
            "kvpool_limit_refusals",
            "Requests and connections refused by a limit on what a peer controls, by limit.",
            None,
            counter_t,
            Limit::ALL.map(|l| {
                let v = match l {
                    Limit::KeyLength => self.long_keys,
                    _ => d.limit_refusals[l as usize].get(),
                };
                ([("limit", l.names().0)], ConstCounter::new(v))
            }),
        )?;
        family(
            e,
            "kvpool_resources",
            "What peers make the node hold beyond their objects, by resource, over every \
             namespace (the resource ledger; bounds in [limits]).",
            None,
            MetricType::Gauge,
            self.resources
                .map(|(name, v)| ([("resource", name)], gauge(v))),
        )?;
        Ok(())
    }

    /// Operation latency: one histogram per operation.
    fn encode_latency(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let d = &*self.daemon;
        let mut latency = e.encode_descriptor(
            "kvpool_operation",
            "Operation latency inside the daemon.",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        for ((_, op), s) in OPS.iter().zip(&d.ops) {
            let buckets: Vec<(f64, u64)> = s
                .buckets
                .iter()
                .enumerate()
                .map(|(b, n)| {
                    let le = if b + 1 < BUCKETS {
                        (1u64 << b) as f64 / 1e6
                    } else {
                        f64::INFINITY
                    };
                    (le, n.load(Ordering::Relaxed))
                })
                .collect();
            let count = buckets.iter().map(|(_, n)| n).sum();
            let sum = s.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
            latency
                .encode_family(&[("op", *op)])?
                .encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;
        }
        Ok(())
    }
}

/// The content type of the page.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Most scrapes served at once; more wait in the listen backlog.
const MAX_SCRAPES: usize = 16;

/// Serves `GET /metrics` until `shutdown` resolves. Anything else gets 404; requests are read
/// into a small fixed buffer and connections are closed after one response. Per-namespace
/// series are shown as `namespaces` says (`Token`: to a request bearing `token`, or to all when
/// the node has none). A failed accept pauses the loop rather than spinning.
pub(crate) async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    (pool, ledger): (Arc<Pool>, Arc<Ledger>),
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
        let (sock, _) = tokio::select! {
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
        let page = Page {
            metrics: metrics.clone(),
            pool: pool.clone(),
            ledger: ledger.clone(),
            namespaces,
            token: token.clone(),
        };
        tokio::spawn(async move {
            let _permit = permit;
            page.answer(sock).await;
        });
    }
}

/// What the metrics listener serves, shared by its connections.
struct Page {
    metrics: Arc<Metrics>,
    pool: Arc<Pool>,
    ledger: Arc<Ledger>,
    namespaces: NamespaceMetrics,
    token: Arc<str>,
}

impl Page {
    /// Reads one request head (up to 4 KiB, within 5 s), answers it and closes.
    async fn answer(&self, mut sock: tokio::net::TcpStream) {
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
        let (status, ctype, body) = self.respond(&String::from_utf8_lossy(&buf[..n]));
        let head = format!("HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
        let _ = sock.write_all(head.as_bytes()).await;
        let _ = sock.write_all(body.as_bytes()).await;
        let _ = sock.shutdown().await;
    }

    /// Status, content type and body for the request head `req`.
    fn respond(&self, req: &str) -> (&'static str, &'static str, String) {
        if req.starts_with("GET /metrics ") || req.starts_with("GET /metrics?") {
            let show = match self.namespaces {
                NamespaceMetrics::Off => false,
                NamespaceMetrics::Open => true,
                NamespaceMetrics::Token => self.token.is_empty() || bears(req, &self.token),
            };
            match self.metrics.render(&self.pool, &self.ledger, show) {
                Ok(body) => ("200 OK", OPENMETRICS, body),
                Err(_) => (
                    "500 Internal Server Error",
                    "text/plain",
                    "encoding failed\n".to_string(),
                ),
            }
        } else if req.starts_with("GET /health ") {
            ("200 OK", "text/plain", "ok\n".to_string())
        } else {
            ("404 Not Found", "text/plain", "try /metrics\n".to_string())
        }
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
            && v.next().map(str::trim).is_some_and(|t| {
                kvpool::protocol::auth::token_matches(t.as_bytes(), token.as_bytes())
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_answers_metrics_health_and_nothing_else() {
        let cfg = kvpool::PoolConfig {
            segment_size: 4 << 20,
            backing: kvpool::segment::Backing::Anonymous,
            huge_pages: kvpool::segment::HugePages::Off,
            ..kvpool::PoolConfig::default()
        };
        let page = Page {
            metrics: Arc::default(),
            pool: Arc::new(Pool::new(&cfg, [1; 16]).unwrap()),
            ledger: Ledger::new(&crate::ledger::Bounds::none(), &[1 << 20]),
            namespaces: NamespaceMetrics::Token,
            token: "s3cret".into(),
        };
        let (status, ctype, body) = page.respond("GET /metrics HTTP/1.1\r\n\r\n");
        assert_eq!((status, ctype), ("200 OK", OPENMETRICS));
        assert!(body.contains("kvpool_objects") && body.ends_with("# EOF\n"));
        assert!(!body.contains("kvpool_namespace_objects"), "no token");
        let (_, _, body) =
            page.respond("GET /metrics HTTP/1.1\r\nAuthorization: Bearer s3cret\r\n\r\n");
        assert!(body.contains("kvpool_namespace_objects"));
        let health = page.respond("GET /health HTTP/1.1\r\n\r\n");
        assert_eq!(health, ("200 OK", "text/plain", "ok\n".to_string()));
        assert_eq!(
            page.respond("GET /other HTTP/1.1\r\n\r\n").0,
            "404 Not Found"
        );
    }

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
