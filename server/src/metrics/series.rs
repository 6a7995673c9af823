//! The daemon's own series: what it counts, by label, in lock-free atomics.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvpool::protocol::{LimitCount, NodeTraffic, OpCount};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use kvpool::placement::{ClusterView, NodeState};

use crate::ledger::Limit;

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

pub(super) const OPS: [(OpKind, &str); 17] = [
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
pub(super) const BUCKETS: usize = 25;

/// One operation type: outcome counters and a latency histogram kept in plain atomics (the
/// client library's own histogram takes a lock per observation).
#[derive(Debug, Default)]
pub(super) struct OpStats {
    pub(super) ok: Counter,
    pub(super) err: Counter,
    pub(super) sum_us: AtomicU64,
    pub(super) buckets: [AtomicU64; BUCKETS],
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
    pub(super) fn index(self) -> usize {
        self as usize
    }

    /// Label value.
    pub fn name(self) -> &'static str {
        ["tcp", "quic", "unix", "resp", "tls"][self.index()]
    }
}

pub(super) const TRANSPORTS: [Transport; 5] = [
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

pub(super) const RESP_COMMANDS: [(RespCommand, &str); 22] = [
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

    pub(super) fn index(self) -> usize {
        self as usize
    }
}

/// Why an unauthenticated connection was closed to admit a new one, as labelled on
/// `kvpool_connections_reaped`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReapCause {
    /// The node was at `listen.max_connections`.
    MaxConnections,
    /// An accept failed for lack of descriptors (`EMFILE`, `ENFILE`).
    Descriptors,
}

/// How a handoff's keys were given up, as labelled on `kvpool_handoff_failures`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandoffFailure {
    /// Their producer posted tombstones (`Fail`).
    Failed,
    /// The request was aborted on both sides (`Cancel`).
    Cancelled,
    /// Their handoff lease (`Expire`) lapsed unrenewed and the object was removed.
    Lapsed,
}

pub(super) const HANDOFF_FAILURES: [(HandoffFailure, &str); 3] = [
    (HandoffFailure::Failed, "failed"),
    (HandoffFailure::Cancelled, "cancelled"),
    (HandoffFailure::Lapsed, "lapsed"),
];

/// The states of a node in the cluster view, in the order `kvpool_cluster_nodes` labels them.
pub(super) const NODE_STATES: [NodeState; 5] = NodeState::ALL;

pub(super) const REAP_CAUSES: [(ReapCause, &str); 2] = [
    (ReapCause::MaxConnections, "max_connections"),
    (ReapCause::Descriptors, "descriptors"),
];

/// The daemon's own series: every one a lock-free atomic, indexed by its labels.
#[derive(Debug, Default)]
pub(super) struct Daemon {
    pub(super) ops: [OpStats; OPS.len()],
    pub(super) connections: [Gauge; TRANSPORTS.len()],
    pub(super) connections_accepted: [Counter; TRANSPORTS.len()],
    pub(super) protocol_errors: Counter,
    pub(super) resp_commands: [Counter; RESP_COMMANDS.len()],
    pub(super) resp_errors: [Counter; RESP_COMMANDS.len()],
    pub(super) resp_protocol_errors: Counter,
    pub(super) resp_input_refusals: Counter,
    pub(super) auth_failures: Counter,
    pub(super) auth_throttled: Counter,
    pub(super) cluster_auth_failures: Counter,
    pub(super) cluster_auth_throttled: Counter,
    /// Unauthenticated connections closed to admit new ones, by cause.
    pub(super) reaped: [Counter; REAP_CAUSES.len()],
    /// Requests and connections refused by a limit, by limit.
    pub(super) limit_refusals: [Counter; Limit::ALL.len()],
    pub(super) bytes_in: Counter,
    pub(super) bytes_out: Counter,
    /// Bulk chunks and their bytes by priority (Background .. High).
    pub(super) bulk_chunks: [Counter; 4],
    pub(super) bulk_bytes: [Counter; 4],
    /// Bulk requests refused because their deadline could not be met.
    pub(super) bulk_refused: Counter,
    /// Unpinned objects handed to their new owner after a view change, and their bytes.
    pub(super) handover_objects: Counter,
    pub(super) handover_bytes: Counter,
    /// Copies here dropped without sending: the new owner already held the key, or refused
    /// the copy because it has a newer value or remove.
    pub(super) handover_dropped: Counter,
    /// Objects the last handover pass left here for a later one.
    pub(super) handover_pending: Gauge,
    /// Bytes of the staging areas handed to same-host writers now.
    pub(super) staging_bytes: Gauge,
    /// Bytes registered with the fabric (`[listen] fabric`).
    pub(super) fabric_registered: Gauge,
    /// `FabricInfo` requests answered with the fabric, and refused.
    pub(super) fabric_offers: [Counter; 2],
    /// Handoff keys given up, by how.
    pub(super) handoff_failures: [Counter; HANDOFF_FAILURES.len()],
    /// Nodes in this node's cluster view, by state.
    pub(super) cluster_nodes: [Gauge; NODE_STATES.len()],
    /// KV events: queued for subscribers, dropped for lag, subscribed connections.
    pub(super) kv_events: crate::events::EventSeries,
    /// Bytes of this node's own calls to its peers.
    pub(super) peer_traffic: PeerTraffic,
}

/// What a node's calls to its peers carry, as labelled on `kvpool_peer_bytes`: `kind` is
/// `membership` (heartbeats and gossip) or `data` (everything else: moves, handover copies,
/// lookups, settling reads); `direction` is `sent` (requests) or `received` (replies).
pub(crate) const PEER_KINDS: [&str; 2] = ["membership", "data"];

/// Bytes of this node's calls to its peers, whole frames (prefix, header and payload), by kind
/// ([`PEER_KINDS`]) and direction. Cloned into every connection to a peer; the clones share
/// the counts.
#[derive(Clone, Debug, Default)]
pub(crate) struct PeerTraffic {
    pub(super) sent: [Counter; 2],
    pub(super) received: [Counter; 2],
}

impl PeerTraffic {
    /// One call of kind `membership` (else data): `sent` bytes out, `received` bytes back.
    pub(crate) fn call(&self, membership: bool, sent: u64, received: u64) {
        let k = if membership { 0 } else { 1 };
        self.sent[k].inc_by(sent);
        self.received[k].inc_by(received);
    }
}

/// The daemon's counters.
#[derive(Default)]
pub struct Metrics {
    pub(super) daemon: Arc<Daemon>,
}

impl Metrics {
    /// The counters of this node's calls to its peers, to hand every connection to a peer.
    pub(crate) fn peer_traffic(&self) -> PeerTraffic {
        self.daemon.peer_traffic.clone()
    }

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

    /// The bytes registered with the fabric.
    pub(crate) fn fabric_registered(&self, bytes: u64) {
        self.daemon.fabric_registered.set(bytes as i64);
    }

    /// A `FabricInfo` request answered with the fabric (`served`) or refused.
    pub(crate) fn fabric_offer(&self, served: bool) {
        self.daemon.fabric_offers[usize::from(!served)].inc();
    }

    /// The gauge of the bytes of staging areas handed out, for the areas' registry to keep.
    pub(crate) fn staging_gauge(&self) -> Gauge {
        self.daemon.staging_bytes.clone()
    }

    /// The series of KV events, for the event hub to count into.
    pub(crate) fn event_series(&self) -> crate::events::EventSeries {
        self.daemon.kv_events.clone()
    }

    /// `keys` keys of a handoff given up (`how`).
    pub(crate) fn handoff_failed(&self, how: HandoffFailure, keys: u64) {
        self.daemon.handoff_failures[how as usize].inc_by(keys);
    }

    /// The cluster view this node holds now: its nodes counted by state.
    pub(crate) fn cluster_view(&self, view: &ClusterView) {
        for (gauge, state) in self.daemon.cluster_nodes.iter().zip(NODE_STATES) {
            let n = view.nodes.iter().filter(|n| n.state == state).count();
            gauge.set(n as i64);
        }
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

    /// The traffic counters a `Traffic` request is answered with; `long_keys` is the pool's
    /// count of keys refused for their length (the `KeyLength` limit, counted by the pool).
    pub(crate) fn traffic(&self, long_keys: u64) -> NodeTraffic {
        let d = &*self.daemon;
        let operations = OPS
            .iter()
            .zip(&d.ops)
            .map(|((_, op), s)| OpCount {
                op: (*op).to_string(),
                ok: s.ok.get(),
                error: s.err.get(),
            })
            .collect();
        let refusals = Limit::ALL
            .iter()
            .map(|&l| LimitCount {
                limit: l.names().0.to_string(),
                count: match l {
                    Limit::KeyLength => long_keys,
                    _ => d.limit_refusals[l as usize].get(),
                },
            })
            .collect();
        let open: i64 = d.connections.iter().map(Gauge::get).sum();
        NodeTraffic {
            operations,
            bytes_in: d.bytes_in.get(),
            bytes_out: d.bytes_out.get(),
            refusals,
            connections: open.max(0) as u64,
        }
    }
}
