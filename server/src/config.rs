//! The daemon's configuration: a TOML file, overridden by environment variables, overridden by
//! flags. Every default suits one node on a laptop; docs/OPERATIONS.md lists them all.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use kvpool::pool::NamespaceConfig;
use kvpool::protocol::Limits;
use serde::{Deserialize, Deserializer};

use crate::etcd_gateway::{EtcdAuth, EtcdConfig};
use crate::http::Url;

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

    /// Per namespace (in the pool's id order), `f` of its `[[namespace]]` entry, or `absent`
    /// for a namespace without one (`default` and `weights` when not configured).
    fn per_namespace<T: Clone>(
        &self,
        pool_namespaces: &[(String, u32)],
        absent: T,
        f: impl Fn(&NamespaceEntry) -> T,
    ) -> Vec<T> {
        let mut out = vec![absent; pool_namespaces.len()];
        for (name, id) in pool_namespaces {
            if let Some(n) = self.namespaces.iter().find(|n| &n.name == name) {
                out[*id as usize] = f(n);
            }
        }
        out
    }

    /// Per namespace (in the pool's id order), the tokens that may use it.
    pub fn namespace_tokens(&self, pool_namespaces: &[(String, u32)]) -> Vec<Vec<String>> {
        self.per_namespace(pool_namespaces, Vec::new(), |n| n.tokens.clone())
    }

    /// Per namespace (in the pool's id order), the tokens that may only read it.
    pub fn namespace_read_tokens(&self, pool_namespaces: &[(String, u32)]) -> Vec<Vec<String>> {
        self.per_namespace(pool_namespaces, Vec::new(), |n| n.read_tokens.clone())
    }

    /// Per namespace (in the pool's id order): (replicas, pinned replicas).
    pub fn replication(&self, pool_namespaces: &[(String, u32)]) -> Vec<(u32, u32)> {
        self.per_namespace(pool_namespaces, (1, 2), |n| {
            (n.replicas.max(1), n.pinned_replicas.max(1))
        })
    }

    /// Per namespace (in the pool's id order): its bulk rate cap, bytes per second.
    pub fn bulk_rates(&self, pool_namespaces: &[(String, u32)]) -> Vec<Option<u64>> {
        self.per_namespace(pool_namespaces, None, |n| n.bulk_rate.filter(|&r| r > 0))
    }

    /// How this node learns the cluster: heartbeats to `peers`, or etcd.
    pub(crate) fn membership(&self) -> anyhow::Result<MembershipConfig> {
        let c = &self.cluster;
        if c.etcd.is_empty() {
            return Ok(MembershipConfig::Static {
                peers: c.peers.clone(),
            });
        }
        if !c.peers.is_empty() {
            bail!("cluster: set either peers (static membership) or etcd, not both");
        }
        if c.etcd_prefix.is_empty() {
            bail!("cluster.etcd_prefix must not be empty");
        }
        let endpoints = c
            .etcd
            .iter()
            .map(|u| Url::parse(u).map_err(|e| anyhow::anyhow!("cluster.etcd: {e}")))
            .collect::<anyhow::Result<Vec<Url>>>()?;
        let auth = match (&c.etcd_user, &c.etcd_password_file) {
            (None, None) => None,
            (Some(user), Some(file)) if !user.is_empty() => {
                let text = std::fs::read_to_string(file).map_err(|e| {
                    anyhow::anyhow!("cluster.etcd_password_file {}: {e}", file.display())
                })?;
                let password = text.trim().to_string();
                if password.is_empty() {
                    bail!("cluster.etcd_password_file {} is empty", file.display());
                }
                Some(EtcdAuth {
                    user: user.clone(),
                    password,
                })
            }
            _ => bail!("cluster: etcd_user and etcd_password_file go together"),
        };
        let tls = self.etcd_tls(&endpoints)?;
        Ok(MembershipConfig::Etcd(EtcdConfig {
            endpoints,
            prefix: c.etcd_prefix.clone(),
            auth,
            tls,
        }))
    }

    /// The TLS client configuration for etcd's `https://` endpoints: needed by them, refused
    /// without them (a CA or certificate that would never be used is a mistake worth saying).
    fn etcd_tls(&self, endpoints: &[Url]) -> anyhow::Result<Option<Arc<rustls::ClientConfig>>> {
        let c = &self.cluster;
        let https = endpoints.iter().any(|u| u.tls);
        let client = match (&c.etcd_cert_file, &c.etcd_key_file) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some((cert.as_path(), key.as_path())),
            _ => bail!("cluster: etcd_cert_file and etcd_key_file go together"),
        };
        match (&c.etcd_ca_file, https) {
            (None, false) if client.is_none() => Ok(None),
            (Some(ca), true) => crate::tls::https_client_config(ca, client)
                .map(|t| Some(Arc::new(t)))
                .map_err(|e| anyhow::anyhow!("cluster.etcd_ca_file: {e:#}")),
            (None, true) => bail!(
                "cluster.etcd has https:// URLs: set cluster.etcd_ca_file to the CA that \
                 signed etcd's certificate"
            ),
            (_, false) => bail!(
                "cluster: etcd_ca_file, etcd_cert_file and etcd_key_file are for https:// \
                 etcd URLs, and every URL is http://"
            ),
        }
    }

    /// The wire limits.
    pub fn wire_limits(&self) -> anyhow::Result<Limits> {
        let l = &self.limits;
        if l.max_header == 0 || l.max_header > u32::MAX as u64 || l.max_batch == 0 {
            bail!("limits: max_header must be 1..4GiB and max_batch at least 1");
        }
        if !(1..=kvpool::MAX_KEY_LEN as u32).contains(&l.max_key_len) {
            bail!(
                "limits: max_key_len must be 1..={} (the format's longest key)",
                kvpool::MAX_KEY_LEN
            );
        }
        if l.max_pending_per_connection == 0 {
            bail!("limits: max_pending_per_connection must be at least 1");
        }
        self.ledger_bounds()?;
        Ok(Limits {
            max_header: l.max_header as u32,
            max_payload: l.max_payload,
            max_batch: l.max_batch,
        })
    }

    /// The bounds of the resource ledger (`[limits] max_*_per_connection`,
    /// `max_*_per_namespace`, `max_held_share`, `max_staging_per_token`).
    pub(crate) fn ledger_bounds(&self) -> anyhow::Result<crate::ledger::Bounds> {
        use crate::ledger::Resource;
        let l = &self.limits;
        let per_namespace = [
            ("max_pending_per_namespace", l.max_pending_per_namespace),
            ("max_holds_per_namespace", l.max_holds_per_namespace),
            ("max_watches_per_namespace", l.max_watches_per_namespace),
            (
                "max_subscriptions_per_namespace",
                l.max_subscriptions_per_namespace,
            ),
            ("max_leases_per_namespace", l.max_leases_per_namespace),
            (
                "max_tombstones_per_namespace",
                l.max_tombstones_per_namespace,
            ),
        ];
        if let Some((name, _)) = per_namespace.iter().find(|(_, v)| *v == 0) {
            bail!("limits: {name} must be at least 1");
        }
        if !(l.max_held_share > 0.0 && l.max_held_share <= 1.0) {
            bail!("limits: max_held_share must be more than 0 and at most 1");
        }
        let mut b = crate::ledger::Bounds {
            per_connection: [0; crate::ledger::RESOURCES.len()],
            per_namespace: [0; crate::ledger::RESOURCES.len()],
            held_share: l.max_held_share,
            staging_per_token: l.max_staging_per_token,
        };
        let mut set = |r: Resource, conn: u32, ns: u32| {
            b.per_connection[r as usize] = conn as u64;
            b.per_namespace[r as usize] = ns as u64;
        };
        set(
            Resource::Pending,
            l.max_pending_per_connection,
            l.max_pending_per_namespace,
        );
        set(
            Resource::Holds,
            l.max_holds_per_connection,
            l.max_holds_per_namespace,
        );
        set(
            Resource::Watches,
            l.max_watches_per_connection,
            l.max_watches_per_namespace,
        );
        set(
            Resource::Subscriptions,
            l.max_subscriptions_per_connection,
            l.max_subscriptions_per_namespace,
        );
        set(Resource::Leases, 0, l.max_leases_per_namespace);
        set(Resource::Tombstones, 0, l.max_tombstones_per_namespace);
        Ok(b)
    }

    /// The wire limits before the handshake: a small header and no payload (a `Hello` has
    /// none).
    pub fn hello_limits(&self) -> anyhow::Result<Limits> {
        let l = self.wire_limits()?;
        let max = self.limits.max_header_unauthenticated;
        if max == 0 || max > l.max_header as u64 {
            bail!("limits: max_header_unauthenticated must be 1..=max_header");
        }
        Ok(Limits {
            max_header: max as u32,
            max_payload: 0,
            ..l
        })
    }

    /// The pool's configuration.
    pub fn pool_config(&self) -> anyhow::Result<kvpool::PoolConfig> {
        use kvpool::segment::{Backing, HugePages};
        let m = &self.memory;
        let backing = match m.backing.as_str() {
            "shm" | "file" => Backing::File(self.data_dir()),
            "anonymous" => Backing::Anonymous,
            other => bail!("memory.backing must be \"shm\" or \"anonymous\", not {other:?}"),
        };
        let huge_pages = match m.huge_pages.as_str() {
            "auto" => HugePages::Auto,
            "off" => HugePages::Off,
            other => bail!("memory.huge_pages must be \"auto\" or \"off\", not {other:?}"),
        };
        let mut namespaces: Vec<NamespaceConfig> = self
            .namespaces
            .iter()
            .map(|n| {
                Ok(NamespaceConfig {
                    name: n.name.clone(),
                    quota_bytes: n.quota,
                    eviction: n
                        .eviction
                        .parse()
                        .map_err(|e: String| anyhow::anyhow!("namespace {:?}: {e}", n.name))?,
                    own_segment: n.own_segment.unwrap_or(
                        n.quota.is_some() && !(n.tokens.is_empty() && n.read_tokens.is_empty()),
                    ),
                })
            })
            .collect::<anyhow::Result<_>>()?;
        if !namespaces
            .iter()
            .any(|n| n.name == kvpool::pool::DEFAULT_NAMESPACE)
        {
            namespaces.insert(
                0,
                NamespaceConfig::unlimited(kvpool::pool::DEFAULT_NAMESPACE),
            );
        }
        // Model weights (docs/WEIGHTS.md) have a namespace of their own on every node, so
        // `kvpool weights put` works on a default daemon; configure it to give it a quota.
        if !namespaces
            .iter()
            .any(|n| n.name == kvpool::weights::DEFAULT_NAMESPACE)
        {
            namespaces.push(NamespaceConfig::unlimited(
                kvpool::weights::DEFAULT_NAMESPACE,
            ));
        }
        Ok(kvpool::PoolConfig {
            node: kvpool::NodeId(self.node_id),
            segment_size: m.size,
            segments: m.segments,
            backing,
            huge_pages,
            prefault: m.prefault,
            alloc: kvpool::alloc::AllocConfig {
                page_size: m.page_size,
                ..Default::default()
            },
            shards: m.shards,
            pending_timeout_ms: m.pending_timeout_ms,
            max_lease_ms: m.max_lease_ms,
            max_key_len: self.limits.max_key_len as usize,
            namespaces,
        })
    }
}

/// How a node learns the cluster.
#[derive(Clone, Debug)]
pub(crate) enum MembershipConfig {
    /// Heartbeats to these peers (and every node they tell of).
    Static {
        /// TCP addresses of other nodes.
        peers: Vec<String>,
    },
    /// Registration in etcd, and the view derived from it.
    Etcd(EtcdConfig),
}

/// Parses `"1GiB"`, `"512 MiB"`, `"64k"`, `"1g"` or a plain number of bytes.
pub fn parse_size(s: &str) -> anyhow::Result<u64> {
    kvpool::units::parse_size(s).map_err(anyhow::Error::msg)
}

/// Parses a socket address, or none for an empty string.
pub fn parse_listen(s: &str) -> anyhow::Result<Option<SocketAddr>> {
    if s.is_empty() {
        return Ok(None);
    }
    Ok(Some(
        s.parse()
            .with_context(|| format!("bad listen address {s:?}"))?,
    ))
}

#[derive(Deserialize)]
#[serde(untagged)]
enum SizeRepr {
    Num(u64),
    Text(String),
}

pub(crate) fn de_size<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    match SizeRepr::deserialize(d)? {
        SizeRepr::Num(n) => Ok(n),
        SizeRepr::Text(s) => parse_size(&s).map_err(serde::de::Error::custom),
    }
}

/// Permission bits: an octal string (`"0660"`) or a TOML integer (`0o660`), at most `0o777`.
fn de_mode<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let n = match SizeRepr::deserialize(d)? {
        SizeRepr::Num(n) => n,
        SizeRepr::Text(s) => u64::from_str_radix(s.trim().trim_start_matches("0o"), 8)
            .map_err(|_| serde::de::Error::custom(format!("{s:?} is not an octal mode")))?,
    };
    u32::try_from(n)
        .ok()
        .filter(|&m| m <= 0o777)
        .ok_or_else(|| serde::de::Error::custom(format!("mode {n:o} is beyond 0777")))
}

fn de_opt_size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_size(d).map(Some)
}

/// Parses a rate in bytes per second: a size (`"500MiB"`), optionally followed by `/s`.
pub fn parse_rate(s: &str) -> anyhow::Result<u64> {
    let t = s.trim();
    parse_size(t.strip_suffix("/s").unwrap_or(t).trim_end())
}

fn de_rate<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    match SizeRepr::deserialize(d)? {
        SizeRepr::Num(n) => Ok(n),
        SizeRepr::Text(s) => parse_rate(&s).map_err(serde::de::Error::custom),
    }
}

fn de_opt_rate<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_rate(d).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("512 MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("64k").unwrap(), 64 << 10);
        assert_eq!(parse_size("123").unwrap(), 123);
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(parse_rate("2GiB/s").unwrap(), 2 << 30);
        assert_eq!(parse_rate("500MiB").unwrap(), 500 << 20);
        assert!(parse_rate("fast").is_err());
    }

    #[test]
    fn a_full_file_parses_and_unknown_keys_are_refused() {
        let c = Config::from_toml(
            r#"
            node_id = 2
            data_dir = "/tmp/x"
            [memory]
            size = "256MiB"
            segments = 2
            [listen]
            tcp = "127.0.0.1:9000"
            quic = ""
            [[namespace]]
            name = "tenant-a"
            quota = "64MiB"
            eviction = "lru"
            pinned_replicas = 3
            [cluster]
            peers = ["127.0.0.1:9100", "127.0.0.1:9200"]
            heartbeat_ms = 100
            handover_max_bytes = "1GiB"
            "#,
        )
        .unwrap();
        assert_eq!(c.memory.size, 256 << 20);
        assert_eq!(c.cluster.peers.len(), 2);
        assert_eq!(c.cluster.heartbeat_ms, 100);
        assert_eq!(c.cluster.down_after_ms, 2_000, "the default");
        assert!(c.cluster.handover, "the default");
        assert_eq!(c.cluster.handover_max_bytes, 1 << 30);
        assert!(
            !Config::from_toml("[cluster]\nhandover = false")
                .unwrap()
                .cluster
                .handover
        );
        let ns = [("default".to_string(), 0), ("tenant-a".to_string(), 1)];
        assert_eq!(c.replication(&ns), vec![(1, 2), (1, 3)]);
        assert_eq!(c.namespaces[0].quota, Some(64 << 20));
        assert_eq!(c.unix_path(), PathBuf::from("/tmp/x/kvpool.sock"));
        let p = c.pool_config().unwrap();
        let names: Vec<&str> = p.namespaces.iter().map(|n| &n.name[..]).collect();
        assert_eq!(
            names,
            ["default", "tenant-a", "weights"],
            "default and weights always exist"
        );
        assert_eq!(p.namespaces[1].eviction, kvpool::eviction::PolicyKind::Lru);
        assert_eq!(
            p.namespaces[0].eviction,
            kvpool::eviction::PolicyKind::S3FifoLru,
            "the default"
        );
        let bad = Config::from_toml("[[namespace]]\nname = \"x\"\neviction = \"mru\"").unwrap();
        assert!(bad.pool_config().is_err());
        assert!(Config::from_toml("nonsense = 1").is_err());
        assert!(Config::from_toml("[memory]\nbacking = \"floppy\"")
            .unwrap()
            .pool_config()
            .is_err());
    }

    /// A tenant (a namespace with a quota and tokens, read-only ones too) gets a segment of its
    /// own unless told otherwise; a namespace without tokens or a quota shares the common ones.
    #[test]
    fn tenants_get_segments_of_their_own() {
        let c = Config::from_toml(
            r#"
            [listen]
            unix_mode = "0660"
            [[namespace]]
            name = "tenant"
            quota = "8MiB"
            tokens = ["t"]
            [[namespace]]
            name = "readers"
            quota = "8MiB"
            read_tokens = ["r"]
            [[namespace]]
            name = "shared"
            quota = "8MiB"
            [[namespace]]
            name = "no-quota"
            tokens = ["n"]
            [[namespace]]
            name = "opted-out"
            quota = "8MiB"
            tokens = ["o"]
            own_segment = false
            "#,
        )
        .unwrap();
        assert_eq!(c.listen.unix_mode, 0o660);
        let own: Vec<(String, bool)> = c
            .pool_config()
            .unwrap()
            .namespaces
            .into_iter()
            .map(|n| (n.name, n.own_segment))
            .collect();
        let want = [
            ("default", false),
            ("tenant", true),
            ("readers", true),
            ("shared", false),
            ("no-quota", false),
            ("opted-out", false),
            ("weights", false),
        ];
        assert_eq!(
            own,
            want.map(|(n, o)| (n.to_string(), o)).to_vec(),
            "own segments"
        );
        let ns: Vec<(String, u32)> = ["default", "tenant", "readers"]
            .iter()
            .enumerate()
            .map(|(i, n)| (n.to_string(), i as u32))
            .collect();
        assert_eq!(c.namespace_read_tokens(&ns)[2], ["r"]);
        assert_eq!(Config::default().listen.unix_mode, 0o600);
        assert_eq!(
            Config::from_toml("[listen]\nunix_mode = 0o666")
                .unwrap()
                .listen
                .unix_mode,
            0o666
        );
        assert!(Config::from_toml("[listen]\nunix_mode = \"0999\"").is_err());
        assert!(Config::from_toml("[listen]\nunix_mode = \"01777\"").is_err());
    }

    #[test]
    fn etcd_membership_excludes_peers_and_needs_http_or_https_urls() {
        let c = Config::from_toml(
            "[cluster]\netcd = [\"http://127.0.0.1:2379\", \"http://10.0.0.2:2379/\"]",
        )
        .unwrap();
        assert_eq!(c.cluster.etcd_prefix, "/kvpool/", "the default");
        match c.membership().unwrap() {
            MembershipConfig::Etcd(e) => assert_eq!(e.endpoints.len(), 2),
            other => panic!("{other:?}"),
        }
        let both = "[cluster]\netcd = [\"http://h:1\"]\npeers = [\"h:2\"]";
        assert!(Config::from_toml(both).unwrap().membership().is_err());
        let tls = "[cluster]\netcd = [\"https://h:1\"]";
        let e = Config::from_toml(tls).unwrap().membership().unwrap_err();
        assert!(e.to_string().contains("etcd_ca_file"), "{e}");
        assert!(Config::from_toml("[cluster]\netcd = [\"ftp://h:1\"]")
            .unwrap()
            .membership()
            .is_err());
        assert!(matches!(
            Config::default().membership().unwrap(),
            MembershipConfig::Static { .. }
        ));
    }

    #[test]
    fn etcd_authentication_needs_a_user_and_a_password_file() {
        let dir = kvpool_system_tests::temp_dir("etcd-auth-config");
        let file = dir.join("etcd.password");
        std::fs::write(&file, "  s3cret\n").unwrap();
        let with = |extra: &str| {
            Config::from_toml(&format!("[cluster]\netcd = [\"http://h:1\"]\n{extra}"))
                .unwrap()
                .membership()
        };
        let both = format!(
            "etcd_user = \"kvpool\"\netcd_password_file = \"{}\"",
            file.display()
        );
        match with(&both).unwrap() {
            MembershipConfig::Etcd(e) => {
                let a = e.auth.unwrap();
                assert_eq!((a.user.as_str(), a.password.as_str()), ("kvpool", "s3cret"));
                assert!(
                    !format!("{a:?}").contains("s3cret"),
                    "the password is not logged"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(with("etcd_user = \"kvpool\"").is_err(), "no password file");
        let alone = format!("etcd_password_file = \"{}\"", file.display());
        assert!(with(&alone).is_err(), "no user");
        let missing = "etcd_user = \"kvpool\"\netcd_password_file = \"/nonexistent/pw\"";
        let err = with(missing).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/pw"), "{err}");
        std::fs::write(&file, "\n").unwrap();
        assert!(with(&both).is_err(), "an empty password");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn etcd_over_tls_needs_a_ca_and_https_urls() {
        let dir = kvpool_system_tests::temp_dir("etcd-tls-config");
        let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
        let (ca, key) = (dir.join("ca.pem"), dir.join("key.pem"));
        std::fs::write(&ca, ck.cert.pem()).unwrap();
        std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
        let with = |urls: &str, extra: &str| {
            Config::from_toml(&format!("[cluster]\netcd = [{urls}]\n{extra}"))
                .unwrap()
                .membership()
        };
        let (https, http) = ("\"https://127.0.0.1:1\"", "\"http://127.0.0.1:1\"");
        let ca_line = format!("etcd_ca_file = \"{}\"", ca.display());
        let client = format!(
            "{ca_line}\netcd_cert_file = \"{}\"\netcd_key_file = \"{}\"",
            ca.display(),
            key.display()
        );
        for (urls, extra) in [(https, ca_line.as_str()), (https, client.as_str())] {
            match with(urls, extra).unwrap() {
                MembershipConfig::Etcd(e) => assert!(e.tls.is_some() && e.endpoints[0].tls),
                other => panic!("{other:?}"),
            }
        }
        match with(http, "").unwrap() {
            MembershipConfig::Etcd(e) => assert!(e.tls.is_none()),
            other => panic!("{other:?}"),
        }
        let half = format!("{ca_line}\netcd_cert_file = \"{}\"", ca.display());
        assert!(with(https, &half).is_err(), "a certificate without its key");
        assert!(with(http, &ca_line).is_err(), "a CA with no https URL");
        let missing = "etcd_ca_file = \"/nonexistent/ca.pem\"";
        let e = with(https, missing).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/ca.pem"), "{e}");
        let not_pem = format!("etcd_ca_file = \"{}\"", dir.join("none.pem").display());
        std::fs::write(dir.join("none.pem"), "not a certificate\n").unwrap();
        assert!(with(https, &not_pem).is_err(), "a file with no certificate");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let c = Config::default();
        assert_eq!(c.listen.tcp, "127.0.0.1:7370");
        assert_eq!(c.listen.quic, "127.0.0.1:7371");
        assert_eq!(c.memory.size, 1 << 30);
        assert_eq!(c.data_dir(), PathBuf::from("/dev/shm/kvpool-0"));
        assert_eq!(c.limits.max_header, 8 << 20);
        assert_eq!(c.limits.max_header_unauthenticated, 64 << 10);
        assert_eq!(c.limits.handshake_timeout_ms, 10_000);
        assert_eq!(c.limits.idle_timeout_ms, 0);
        assert_eq!(c.limits.write_timeout_ms, 30_000);
        assert_eq!(c.limits.read_timeout_ms, 30_000);
        assert_eq!(c.listen.max_connections_per_peer, 256);
        assert_eq!(c.listen.reserve_fds, 64);
        assert_eq!(c.listen.metrics_namespaces, NamespaceMetrics::Off);
        assert_eq!(
            (c.limits.auth_failures, c.limits.auth_failure_refill_ms),
            (10, 1_000)
        );
        assert_eq!(c.limits.auth_failures_per_second, 100);
        assert_eq!(c.limits.cluster_auth_failures_per_second, 20);
        let budgets = Config::from_toml(
            "[limits]\nauth_failures_per_second = 5\ncluster_auth_failures_per_second = 0",
        )
        .unwrap();
        assert_eq!(budgets.limits.auth_failures_per_second, 5);
        assert_eq!(budgets.limits.cluster_auth_failures_per_second, 0);
        let h = c.hello_limits().unwrap();
        assert_eq!((h.max_header, h.max_payload), (64 << 10, 0));
        let open = Config::from_toml("[listen]\nmetrics_namespaces = \"token\"").unwrap();
        assert_eq!(open.listen.metrics_namespaces, NamespaceMetrics::Token);
        assert!(Config::from_toml("[listen]\nmetrics_namespaces = \"maybe\"").is_err());
    }
}
