//! The configuration file's sections: plain data, each field with its default.

use std::path::{Path, PathBuf};

use anyhow::Context;
use kvpool::protocol::Limits;
use serde::Deserialize;

use super::parse::{de_mode, de_opt_rate, de_opt_size, de_rate, de_size};

/// Everything `kvpoold` can be told.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// This node's id, unique in the cluster. Default 0.
    pub node_id: u32,
    /// Segment files, the Unix socket and the generated TLS certificate live here.
    /// Default `/dev/shm/kvpool-<node_id>`.
    pub data_dir: Option<PathBuf>,
    /// Memory contributed to the pool.
    pub memory: MemoryConfig,
    /// Where to listen.
    pub listen: ListenConfig,
    /// Limits on what a client may send.
    pub limits: LimitsConfig,
    /// Authentication.
    pub auth: AuthConfig,
    /// TLS for QUIC.
    pub tls: TlsConfig,
    /// Namespaces (`default` always exists).
    #[serde(rename = "namespace")]
    pub namespaces: Vec<NamespaceEntry>,
    /// How long shutdown waits for in-flight requests, ms. Default 10 000.
    pub drain_timeout_ms: u64,
    /// Membership in a cluster of nodes.
    pub cluster: ClusterConfig,
    /// Bounds of the Redis-protocol front door (`listen.resp`).
    pub resp: RespConfig,
    /// The disk tier under DRAM: off unless `disk.path` is set.
    pub disk: DiskConfig,
}

/// `[cluster]`. With no peers and no etcd the node is a cluster of one, which other nodes may
/// still join.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// TCP addresses (`host:port`) of other nodes to heartbeat (static membership). Default none.
    pub peers: Vec<String>,
    /// etcd client URLs (`http://host:port`, or `https://host:port` with `etcd_ca_file`):
    /// membership through etcd instead of heartbeats (then `peers` must be empty). Default
    /// none.
    pub etcd: Vec<String>,
    /// Prefix of this cluster's keys in etcd, so several clusters can share one. Default
    /// `"/kvpool/"`.
    pub etcd_prefix: String,
    /// User of etcd's own authentication (`etcdctl auth enable`): the node trades this user's
    /// password for a token and sends it with every request, so the user needs read and write
    /// permission on `etcd_prefix`. Needs `etcd_password_file`. Default none (etcd's
    /// authentication off).
    pub etcd_user: Option<String>,
    /// File holding `etcd_user`'s password (its text with surrounding whitespace removed), so
    /// the password is in neither the config nor the command line. Default none.
    pub etcd_password_file: Option<PathBuf>,
    /// CA certificates (PEM) that etcd's server certificate is verified against, for
    /// `https://` URLs (which need it); the certificate must also name the URL's host or IP
    /// address. Default none.
    pub etcd_ca_file: Option<PathBuf>,
    /// Client certificate chain (PEM) presented to etcd over TLS, for etcd's
    /// `--client-cert-auth`. Needs `etcd_key_file` and `https://` URLs. Default none.
    pub etcd_cert_file: Option<PathBuf>,
    /// The private key (PEM) of `etcd_cert_file`. Default none.
    pub etcd_key_file: Option<PathBuf>,
    /// The TCP address other nodes and clients reach this node at. Default: the bound TCP
    /// address.
    pub advertise: Option<String>,
    /// Heartbeat period, ms. Default 500.
    pub heartbeat_ms: u64,
    /// A peer silent for this long is marked down, ms. Default 2 000.
    pub down_after_ms: u64,
    /// Longest a drain waits for pinned objects to find their new owners, ms. Default 60 000.
    pub drain_timeout_ms: u64,
    /// Drain before exiting on SIGTERM when other nodes are serving. Default true.
    pub drain_on_shutdown: bool,
    /// On SIGTERM, when other nodes are serving and the segments are files (`memory.backing =
    /// "shm"`), announce a restart in place instead of draining: the node's keys stay its own
    /// while it is away (reads of them miss, writes of them are refused), and a process
    /// started on the same data directory and address within `restart_window_ms` serves the
    /// objects it recovered again (docs/OPERATIONS.md, "Rolling restarts"). Default false.
    pub restart_on_shutdown: bool,
    /// How long the other nodes hold a restarting node's keys for it before marking it down,
    /// ms; the same on every node. Default 60 000.
    pub restart_window_ms: u64,
    /// Hand unpinned objects (KV blocks) to their new owners when this node drains or another
    /// joins, the hottest within `handover_max_bytes`, as background bulk traffic
    /// (docs/RELIABILITY.md, "Elastic"). Only namespaces with one replica take part. Default
    /// true.
    pub handover: bool,
    /// Most bytes one handover pass sends (`"8GiB"` or a number; 0: no limit); the colder rest
    /// follows in later passes (one every 5 s; every heartbeat in a drain). Default 0.
    #[serde(deserialize_with = "de_size")]
    pub handover_max_bytes: u64,
    /// File holding the cluster secret, which every node of the cluster shares and clients
    /// never see: cluster control (gossip, drain, moving objects) needs it. Default none: the
    /// node uses `<data_dir>/cluster.secret`, generating it (mode 0600) when absent and the
    /// node joins no one (no `peers`, no `etcd`); a node that joins others must be given the
    /// cluster's secret (see [`crate::secret`]).
    pub secret_file: Option<PathBuf>,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            peers: Vec::new(),
            etcd: Vec::new(),
            etcd_prefix: "/kvpool/".into(),
            etcd_user: None,
            etcd_password_file: None,
            etcd_ca_file: None,
            etcd_cert_file: None,
            etcd_key_file: None,
            advertise: None,
            heartbeat_ms: 500,
            down_after_ms: 2_000,
            drain_timeout_ms: 60_000,
            drain_on_shutdown: true,
            restart_on_shutdown: false,
            restart_window_ms: 60_000,
            handover: true,
            handover_max_bytes: 0,
            secret_file: None,
        }
    }
}

/// `[memory]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemoryConfig {
    /// Bytes per segment (`"1GiB"`, `"512MiB"` or a number). Default 1 GiB.
    #[serde(deserialize_with = "de_size")]
    pub size: u64,
    /// Number of segments. Default 1.
    pub segments: u32,
    /// `"shm"` (files in the data dir, mappable by same-host clients) or `"anonymous"`.
    /// Default `"shm"`.
    pub backing: String,
    /// `"auto"` (huge pages when available, logged) or `"off"`. Default `"auto"`.
    pub huge_pages: String,
    /// Fault all memory in at start. Default false.
    pub prefault: bool,
    /// Bytes kept faulted in ahead of the allocations by a background thread (never more
    /// than the allocations reached so far); 0 turns it off. Default 256 MiB.
    #[serde(deserialize_with = "de_size")]
    pub prefault_ahead: u64,
    /// Allocator page size. Default 64 KiB.
    #[serde(deserialize_with = "de_size")]
    pub page_size: u64,
    /// Index shards. Default 1 (see `PoolConfig::shards` for the trade-off).
    pub shards: usize,
    /// Uncommitted allocations are reclaimed after this, ms. Default 30 000.
    pub pending_timeout_ms: u64,
    /// Longest lease, ms. Default 30 000.
    pub max_lease_ms: u64,
    /// How a same-host client's puts reach a segment: `"direct"` (a token that may write every
    /// namespace of a segment maps it read-write and stores values into its allocations
    /// itself), `"staged"` (every segment is mapped read-only; the client writes values into a
    /// staging area of its own and the node copies them into their allocations at commit, so a
    /// client's stores can only ever land in allocations it was given), or `"auto"`: staged for
    /// segments that hold a namespace with tokens (another tenant's, or a tenant's own committed
    /// objects), direct where every namespace is open. Default `"auto"`.
    pub same_host_writes: String,
    /// Bytes of one staging area (`same_host_writes`); 0: none, same-host writers of staged
    /// segments put over the socket. Default 64 MiB.
    #[serde(deserialize_with = "de_size")]
    pub staging: u64,
    /// Most bytes of staging areas the node hands out at once, over all clients; a client asking
    /// past it gets none and puts over the socket. Default 1 GiB.
    #[serde(deserialize_with = "de_size")]
    pub staging_total: u64,
}

/// `[listen]`. An empty string disables a listener.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ListenConfig {
    /// TCP, the default data path. Default `127.0.0.1:7370`.
    pub tcp: String,
    /// QUIC (TLS 1.3). Default `127.0.0.1:7371`.
    pub quic: String,
    /// Prometheus metrics over HTTP. Default `127.0.0.1:7372`.
    pub metrics: String,
    /// Unix socket path. Default `<data_dir>/kvpool.sock`.
    pub unix: Option<PathBuf>,
    /// Permission bits of the Unix socket (`"0600"`: the daemon's user only, the default;
    /// `"0666"`: every local user, who then authenticates by token like over TCP). Its segments
    /// are handed to a connection as descriptors after authentication, never by path.
    #[serde(deserialize_with = "de_mode")]
    pub unix_mode: u32,
    /// The Redis-protocol (RESP2/RESP3) front door, e.g. `127.0.0.1:6380`. Default `""`: off.
    pub resp: String,
    /// The native protocol over TCP with TLS 1.3 (clients: `tls://host:port`), with QUIC's
    /// certificate (`[tls]`, or the generated one), e.g. `0.0.0.0:7373`. Default `""`: off.
    pub tls: String,
    /// One-sided reads of the segments over libfabric (clients: `fabric://host:port`, with
    /// `host:port` the TCP listener's): the provider, `tcp`, `verbs;ofi_rxm` (InfiniBand,
    /// RoCE), `efa` or `shm`. Default `""`: off. libfabric's own variables choose its
    /// interface (`FI_TCP_IFACE`, `FI_VERBS_IFACE`).
    pub fabric: String,
    /// Most concurrent connections (QUIC streams count as connections). Default 1024. Lowered
    /// at start to what the open-file limit allows after `reserve_fds`.
    pub max_connections: usize,
    /// Most concurrent TCP connections from one IP address; 0 for no cap. Default 256. A
    /// connection over the cap is closed as soon as it is accepted.
    pub max_connections_per_peer: usize,
    /// File descriptors kept out of `max_connections` for segments, cluster links, etcd and
    /// metrics scrapes. Default 64.
    pub reserve_fds: u64,
    /// Per-namespace series (names and usage) on the metrics page: `"off"` (the default),
    /// `"token"` (only for a scrape with `Authorization: Bearer <auth.token>`) or `"open"`.
    pub metrics_namespaces: NamespaceMetrics,
}

/// Who sees the per-namespace series of the metrics page.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NamespaceMetrics {
    /// Nobody: namespace names stay private.
    #[default]
    Off,
    /// Scrapes that present the node token as a bearer token (everyone when the node has
    /// no token, as for the data plane).
    Token,
    /// Every scrape.
    Open,
}

/// `[limits]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Largest request header. Default 8 MiB.
    #[serde(deserialize_with = "de_size")]
    pub max_header: u64,
    /// Largest payload (value or batch). Default 1 GiB.
    #[serde(deserialize_with = "de_size")]
    pub max_payload: u64,
    /// Most keys per batch. Default 16 384.
    pub max_batch: u32,
    /// Largest header before the handshake (the `Hello`), when a peer has not yet
    /// authenticated. Default 64 KiB.
    #[serde(deserialize_with = "de_size")]
    pub max_header_unauthenticated: u64,
    /// A connection that has not completed its handshake this long after it was accepted is
    /// closed, ms. Default 10 000.
    pub handshake_timeout_ms: u64,
    /// An authenticated connection idle between requests this long is closed, ms; 0 for never.
    /// Default 0.
    pub idle_timeout_ms: u64,
    /// Objects one connection may hold for reading in place (`Hold`, the same-host zero-copy
    /// views of model weights) at once; a `Hold` beyond it is refused whole. Default 65 536.
    pub max_holds_per_connection: u32,
    /// Objects held (`Hold`) in one namespace at once, over every connection. Default 262 144.
    pub max_holds_per_namespace: u32,
    /// Share of a namespace's memory (its quota, or the memory nobody reserved, which it
    /// shares) that objects held in it (`Hold`) may take at once, between 0 and 1: a held
    /// object's memory is neither evicted nor reused, even once it is removed or replaced, so
    /// readers that hold can't park more than this of it. Default 0.5.
    pub max_held_share: f64,
    /// Keys one connection may watch at once (`Watch`: handoff notifications); beyond it a
    /// `Watch` is refused whole with `LimitExceeded`. Default 65 536.
    pub max_watches_per_connection: u32,
    /// Keys watched in one namespace at once, over every connection. Default 262 144.
    pub max_watches_per_namespace: u32,
    /// Prefixes one connection may subscribe to at once (`Subscribe`: every commit of the
    /// namespace is matched against each). Default 64.
    pub max_subscriptions_per_connection: u32,
    /// Prefixes subscribed to in one namespace at once, over every connection. Default 4 096.
    pub max_subscriptions_per_namespace: u32,
    /// KV event subscriptions (`KvEvents`, `kvpool events`) one connection may hold at once;
    /// beyond it a `KvEvents` is refused with `LimitExceeded`. Default 8.
    pub max_event_subscriptions_per_connection: u32,
    /// KV event subscriptions in one namespace at once, over every connection (each
    /// subscribed connection has a queue of 128 KiB, twice). Default 64.
    pub max_event_subscriptions_per_namespace: u32,
    /// Allocations one connection may have pending at once (`Alloc` without its `Commit` or
    /// `Abort`; those reaped or committed elsewhere no longer count); an `Alloc` beyond it is
    /// refused whole with `LimitExceeded`. Default 65 536 (four of the largest batch).
    pub max_pending_per_connection: u32,
    /// Allocations pending in one namespace at once, over every connection. Default 262 144.
    pub max_pending_per_namespace: u32,
    /// Keys of one namespace under a handoff lease (`Expire`) at once; an `Expire` that would
    /// pass it is refused with `LimitExceeded`. Default 262 144.
    pub max_leases_per_namespace: u32,
    /// Tombstones (`Fail`, `Cancel`) one namespace may have in force at once; a `Fail` that
    /// would pass it is refused with `LimitExceeded`. Default 65 536.
    pub max_tombstones_per_namespace: u32,
    /// Bytes of staging areas (`memory.staging`) the connections of one token may hold at
    /// once (clients without a token count as one); past it a client puts over the socket.
    /// Default 256 MiB (four areas).
    #[serde(deserialize_with = "de_size")]
    pub max_staging_per_token: u64,
    /// Connections (and QUIC streams) one token may have authenticated at once, across every
    /// door (native `Hello`, RESP `AUTH`/`HELLO`); 0 for no cap. A connection without a token
    /// is not counted here (`listen.max_connections_per_peer` caps it by address). Default 0.
    pub max_connections_per_token: u32,
    /// Longest key, in bytes, 1 to 256 (the format's maximum); a longer key is refused with
    /// `BadKey` by every door. Default 256.
    pub max_key_len: u32,
    /// How long a producer's tombstone (`Fail`) is kept, ms. Default 60 000.
    pub tombstone_ms: u64,
    /// A reply the peer does not read for this long (no progress writing it) is dropped with
    /// its connection, releasing the objects it referenced, ms. Default 30 000.
    pub write_timeout_ms: u64,
    /// A request whose bytes stop arriving once its first byte has (no progress reading the
    /// rest of its frame or its payload) for this long is dropped with its connection, ms.
    /// Waiting between requests is `idle_timeout_ms`'s. Default 30 000.
    pub read_timeout_ms: u64,
    /// A request whose payload (a put's or a reply's) is at least this large is bulk: it moves
    /// a chunk at a time, taking turns with other bulk transfers (ARCHITECTURE.md,
    /// "Scheduling large and small requests"). Default 256 KiB.
    #[serde(deserialize_with = "de_size")]
    pub bulk_threshold: u64,
    /// Most bulk chunks moving at once; 0: one fewer than the node's cores (at least 1), so a
    /// worker is always free for small requests, and every core while the node has served no
    /// small request for 50 ms (the kept worker is kept only for small requests that come; a
    /// set count is a hard cap). Default 0.
    pub bulk_workers: u32,
    /// Cap on the node's bulk bytes per second (`"500MiB"`, `"2GiB/s"`); 0: none. The
    /// cluster's own moves count. Default 0 (flag `--bulk-rate`).
    #[serde(deserialize_with = "de_rate")]
    pub bulk_rate: u64,
    /// Longest one bulk chunk holds its turn, ms: a chunk still moving after it (a peer reading
    /// slowly) carries on without it. Default 2.
    pub bulk_hold_ms: u64,
    /// Wrong tokens (in a `Hello` or a RESP `AUTH`) one peer address may present in a row;
    /// after that it may try once per `auth_failure_refill_ms`, and its other attempts are
    /// refused unchecked. 0: no limit. Default 10.
    pub auth_failures: u32,
    /// See `auth_failures`, ms. Default 1 000.
    pub auth_failure_refill_ms: u64,
    /// Wrong tokens (every door, every address together) the node checks per second, a
    /// second's worth in a burst. While they are spent, an attempt from an address with a
    /// failure not yet paid back (`auth_failure_refill_ms` per failure) is refused unchecked;
    /// one from an address with none is checked. 0: no such budget. Default 100 (flag
    /// `--auth-failures-per-second`).
    pub auth_failures_per_second: u32,
    /// The same budget for wrong proofs of the cluster secret (`ClusterAuth`), which have no
    /// per-address allowance. 0: none. Default 20 (flag `--cluster-auth-failures-per-second`).
    pub cluster_auth_failures_per_second: u32,
}

/// `[auth]`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Token every client must present in its handshake; empty for none. Default empty.
    pub token: String,
}

/// `[tls]`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// PEM certificate chain; empty: a self-signed one is generated into the data dir.
    pub cert: Option<PathBuf>,
    /// PEM private key, with `cert`.
    pub key: Option<PathBuf>,
}

/// `[resp]`: bounds on what a RESP client may send. Defaults are Redis's.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RespConfig {
    /// Largest bulk string (a key or a value); also capped by `limits.max_payload`. Default
    /// 512 MiB (Redis's `proto-max-bulk-len`).
    #[serde(deserialize_with = "de_size")]
    pub max_bulk: u64,
    /// Most arguments in one command. Default 1 048 576.
    pub max_args: u64,
    /// Longest inline command. Default 64 KiB.
    #[serde(deserialize_with = "de_size")]
    pub max_inline: u64,
    /// Most bytes of one command. Default 1 GiB (Redis's `client-query-buffer-limit`).
    #[serde(deserialize_with = "de_size")]
    pub max_command: u64,
    /// Most index slots one `SCAN` call looks at, whatever its `COUNT`. Default 10 000.
    pub max_scan_count: u64,
    /// Most keys with a TTL (`SET ... EX|PX`) pending at once; a SET with a TTL beyond it is
    /// refused. Default 1 048 576.
    pub max_expiring_keys: u64,
    /// Most bytes the weights view (SGLang's remote loader, docs/WEIGHTS.md) holds at once for
    /// tensors being assembled, across the door's connections; also the largest tensor it
    /// serves. Default 2 GiB.
    #[serde(deserialize_with = "de_size")]
    pub weights_memory: u64,
    /// Most bytes all RESP connections together hold in input buffers beyond the first 64 KiB
    /// each (commands being parsed whole, and read-ahead). A connection whose next command would
    /// take the node past it is answered with an error and closed. Default 1 GiB.
    #[serde(deserialize_with = "de_size")]
    pub input_memory: u64,
}

impl Default for RespConfig {
    fn default() -> Self {
        let l = kvpool::resp::RespLimits::default();
        RespConfig {
            max_bulk: l.max_bulk,
            max_args: l.max_args,
            max_inline: l.max_inline as u64,
            max_command: l.max_command,
            max_scan_count: 10_000,
            max_expiring_keys: 1 << 20,
            weights_memory: 2 << 30,
            input_memory: 1 << 30,
        }
    }
}

impl RespConfig {
    /// The parser's limits once a connection is authenticated; `max_payload` caps a value.
    pub fn limits(&self, max_payload: u64) -> kvpool::resp::RespLimits {
        kvpool::resp::RespLimits {
            max_bulk: self.max_bulk.min(max_payload),
            max_args: self.max_args,
            max_inline: self.max_inline.min(usize::MAX as u64) as usize,
            max_command: self.max_command,
        }
    }
}

/// `[disk]`: a second tier on local disk that objects evicted from DRAM are written to. Off
/// unless `path` is set: a disk tier needs a directory, on a disk, that the operator chooses
/// and sizes; no default place would be right on every node (the data directory is in
/// `/dev/shm`, which is DRAM).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiskConfig {
    /// Directory of the tier's region files (created if missing). Default none: the tier off.
    pub path: Option<PathBuf>,
    /// Most bytes the tier's files hold together (`"64GiB"` or a number): needed with `path`,
    /// at least two regions. Default none.
    #[serde(deserialize_with = "de_opt_size")]
    pub capacity: Option<u64>,
    /// Bytes of one region, the unit dropped (oldest first) when the tier is full: a positive
    /// multiple of 4 KiB. Default 64 MiB.
    #[serde(deserialize_with = "de_size")]
    pub region_size: u64,
    /// Most bytes of evicted objects waiting to be written to disk; an eviction that would pass
    /// it is not written (and counted). Default 256 MiB.
    #[serde(deserialize_with = "de_size")]
    pub queue: u64,
    /// Which evicted objects are worth a disk write: `"all"`, or `"read-once"` (only those read
    /// at least once while in DRAM, sparing the disk's endurance the blocks nobody came back
    /// for). Default `"read-once"`.
    pub admit: DiskAdmit,
    /// How the tier's files are read and written: `"direct"` (`O_DIRECT`, around the page
    /// cache; a file system that refuses it falls back to `"buffered"`, with a warning) or
    /// `"buffered"` (`pread`/`pwrite` through the page cache). Default `"direct"`.
    #[serde(deserialize_with = "de_io_engine")]
    pub io: kvpool::disk::IoEngine,
}

fn de_io_engine<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<kvpool::disk::IoEngine, D::Error> {
    let s = String::deserialize(d)?;
    s.parse().map_err(serde::de::Error::custom)
}

/// Which evicted objects the disk tier takes (`[disk] admit`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DiskAdmit {
    /// Every evicted unpinned object.
    All,
    /// Only objects read at least once while in DRAM.
    #[default]
    ReadOnce,
}

impl DiskAdmit {
    /// Parses the names `[disk] admit` takes: `"all"` or `"read-once"`.
    pub fn parse(s: &str) -> anyhow::Result<DiskAdmit> {
        match s {
            "all" => Ok(DiskAdmit::All),
            "read-once" => Ok(DiskAdmit::ReadOnce),
            other => anyhow::bail!("disk.admit must be \"all\" or \"read-once\", not {other:?}"),
        }
    }
}

impl Default for DiskConfig {
    fn default() -> Self {
        DiskConfig {
            path: None,
            capacity: None,
            region_size: kvpool::disk::DEFAULT_REGION_SIZE,
            queue: 256 << 20,
            admit: DiskAdmit::ReadOnce,
            io: kvpool::disk::IoEngine::Direct,
        }
    }
}

/// `[[namespace]]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceEntry {
    /// Name.
    pub name: String,
    /// Byte quota on this node (`"4GiB"`); none when absent.
    #[serde(default, deserialize_with = "de_opt_size")]
    pub quota: Option<u64>,
    /// Tokens that may use this namespace; empty (the default, with no `read_tokens` either):
    /// every client the node admits.
    #[serde(default)]
    pub tokens: Vec<String>,
    /// Tokens that may only read this namespace (get, probe, list, watch): their writes and
    /// removals are refused, and their same-host mapping of its segment is read-only.
    #[serde(default)]
    pub read_tokens: Vec<String>,
    /// Keep the namespace in a segment of its own, of its quota's size (carved out of the
    /// pool's memory), so that same-host clients of other tenants never map its bytes, nor it
    /// theirs. Default: true for a namespace with a quota and tokens (a tenant), false
    /// otherwise; true without a quota is refused.
    #[serde(default)]
    pub own_segment: Option<bool>,
    /// Eviction policy: `s3fifo-lru` (default), `s3fifo`, `lru` or `prefix-aware`.
    #[serde(default = "default_eviction")]
    pub eviction: String,
    /// Nodes holding each unpinned object (KV blocks). Default 1.
    #[serde(default = "one")]
    pub replicas: u32,
    /// Nodes holding each pinned object (model weights). Default 2.
    #[serde(default = "two")]
    pub pinned_replicas: u32,
    /// Cap on this namespace's bulk bytes per second on this node (`"200MiB"`); none when
    /// absent. Over it, its transfers step aside for the other namespaces'.
    #[serde(default, deserialize_with = "de_opt_rate")]
    pub bulk_rate: Option<u64>,
}

fn one() -> u32 {
    1
}

fn two() -> u32 {
    2
}

fn default_eviction() -> String {
    kvpool::eviction::PolicyKind::default().name().to_string()
}

impl Default for Config {
    fn default() -> Self {
        Config {
            node_id: 0,
            data_dir: None,
            memory: MemoryConfig::default(),
            listen: ListenConfig::default(),
            limits: LimitsConfig::default(),
            auth: AuthConfig::default(),
            tls: TlsConfig::default(),
            namespaces: Vec::new(),
            drain_timeout_ms: 10_000,
            cluster: ClusterConfig::default(),
            resp: RespConfig::default(),
            disk: DiskConfig::default(),
        }
    }
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            size: 1 << 30,
            segments: 1,
            backing: "shm".into(),
            huge_pages: "auto".into(),
            prefault: false,
            prefault_ahead: 256 << 20,
            page_size: 64 << 10,
            shards: 1,
            pending_timeout_ms: 30_000,
            max_lease_ms: 30_000,
            same_host_writes: "staged".into(),
            staging: 64 << 20,
            staging_total: 1 << 30,
        }
    }
}

impl Default for ListenConfig {
    fn default() -> Self {
        ListenConfig {
            tcp: "127.0.0.1:7370".into(),
            quic: "127.0.0.1:7371".into(),
            metrics: "127.0.0.1:7372".into(),
            unix: None,
            unix_mode: 0o600,
            resp: String::new(),
            tls: String::new(),
            fabric: String::new(),
            max_connections: 1024,
            max_connections_per_peer: 256,
            reserve_fds: 64,
            metrics_namespaces: NamespaceMetrics::Off,
        }
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        let l = Limits::default();
        LimitsConfig {
            max_header: l.max_header as u64,
            max_payload: l.max_payload,
            max_batch: l.max_batch,
            max_header_unauthenticated: kvpool::protocol::MAX_HELLO_HEADER as u64,
            handshake_timeout_ms: 10_000,
            idle_timeout_ms: 0,
            max_holds_per_connection: 65_536,
            max_holds_per_namespace: 262_144,
            max_held_share: 0.5,
            max_watches_per_connection: 65_536,
            max_watches_per_namespace: 262_144,
            max_subscriptions_per_connection: 64,
            max_subscriptions_per_namespace: 4_096,
            max_event_subscriptions_per_connection: 8,
            max_event_subscriptions_per_namespace: 64,
            max_pending_per_connection: 65_536,
            max_pending_per_namespace: 262_144,
            max_leases_per_namespace: 262_144,
            max_tombstones_per_namespace: 65_536,
            max_staging_per_token: 256 << 20,
            max_connections_per_token: 0,
            max_key_len: kvpool::MAX_KEY_LEN as u32,
            tombstone_ms: 60_000,
            write_timeout_ms: 30_000,
            read_timeout_ms: 30_000,
            bulk_threshold: 256 << 10,
            bulk_workers: 0,
            bulk_rate: 0,
            bulk_hold_ms: 2,
            auth_failures: 10,
            auth_failure_refill_ms: 1_000,
            auth_failures_per_second: 100,
            cluster_auth_failures_per_second: 20,
        }
    }
}

impl Config {
    /// Reads a TOML file.
    pub fn from_file(path: &Path) -> anyhow::Result<Config> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Config::from_toml(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// Parses TOML text.
    pub fn from_toml(text: &str) -> anyhow::Result<Config> {
        Ok(toml::from_str(text)?)
    }

    /// The data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.data_dir
            .clone()
            .unwrap_or_else(|| kvpool::pool::default_dir(kvpool::NodeId(self.node_id)))
    }

    /// The Unix socket path.
    pub fn unix_path(&self) -> PathBuf {
        self.listen
            .unix
            .clone()
            .unwrap_or_else(|| self.data_dir().join("kvpool.sock"))
    }
}
