//! How a client connects and behaves: [`ClientConfig`] and its parts. Plain data with
//! documented defaults; used by every other module of the crate, uses only `connector` (the
//! trait of its one hook).

use std::sync::Arc;
use std::time::Duration;

use crate::connector::Connector;

/// Whether to use the same-host fast path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SameHost {
    /// Use it when the node turns out to run on this host (same kernel boot id and its Unix
    /// socket is reachable): control over the Unix socket, data by direct loads and stores.
    #[default]
    Auto,
    /// Never: every byte goes through the endpoint's transport.
    Off,
}

/// How a client connects and behaves. Every default is documented on its field.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Namespace the client works in. Default `"default"`.
    pub namespace: String,
    /// Auth token for the handshake. Default empty.
    pub token: String,
    /// Name sent in the handshake, for the node's logs. Default `"kvpool-client"`.
    pub client_name: String,
    /// Every call must finish within this. Default 10 s.
    pub timeout: Duration,
    /// Most idle connections kept for reuse, per node and traffic class. Default 16.
    pub max_idle: usize,
    /// Most connections to one node carrying small requests at once; more concurrent calls
    /// wait for one (within their timeout) instead of opening more than a node admits from
    /// one address (`[listen] max_connections_per_peer`, 256). Default 64.
    pub max_connections: usize,
    /// Most connections to one node carrying bulk transfers (a call moving 256 KiB or more)
    /// at once. They are separate from the small requests' connections, so a small request
    /// never queues behind a large one on a socket. Default 8.
    pub max_bulk_connections: usize,
    /// Check the xxh3 checksum of every value received. Default true.
    pub verify_checksums: bool,
    /// Same-host fast path. Default [`SameHost::Auto`].
    pub same_host: SameHost,
    /// PEM CA certificate that QUIC servers must chain to (the daemon's generated
    /// `tls-cert.pem` for a self-signed node). Default none.
    pub ca: Option<std::path::PathBuf>,
    /// Accept any QUIC server certificate. Default false.
    pub insecure_skip_verify: bool,
    /// After the cluster view changes, keys that miss on their new owner are looked up on
    /// their previous owner for this long (one extra hop; the copy is used only when the new
    /// owners vouch that no newer write of the key was acknowledged). Default 60 s.
    pub fallback_window: Duration,
    /// The cluster secret, for operator tools only (`kvpool cluster drain`): every connection
    /// then proves it after the handshake and may send cluster control such as `Drain`.
    /// Applications never hold it. Default none.
    pub cluster_secret: Option<kvpool::protocol::auth::ClusterSecret>,
    /// Priority of this client's bulk transfers on the nodes (a large get or put, a batch):
    /// they take turns with other clients' in proportion to its weight. Small requests are
    /// served at once whatever it says. Default [`Normal`](kvpool::protocol::Priority::Normal).
    pub priority: kvpool::protocol::Priority,
    /// Every call carries this deadline: a node that estimates it cannot finish a bulk
    /// transfer in time refuses it at once (`DeadlineUnmeetable`) instead of making the caller
    /// wait, and the call gives up when it passes (`Timeout`), whichever comes first. Default
    /// none (calls end at `timeout`).
    pub deadline: Option<Duration>,
    /// Same-host objects whose location the client remembers per node, so that a repeated get
    /// of one copies straight from the mapping without a lookup round trip (each copy is
    /// validated as the key's current value; a stale entry is looked up again). 0 turns it
    /// off. Default 65 536 (at most about 260 bytes each with a 32-byte key: a hash map with
    /// room to spare, its eviction round and the key).
    pub local_index: usize,
    /// Opens the streams of every connection in place of the network (see [`Connector`]):
    /// a node served in the same process, a proxy. Connections opened through it never take
    /// the same-host path. Default none: TCP, TLS, QUIC or a Unix socket, as the endpoint
    /// says.
    pub connector: Option<Arc<dyn Connector>>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            namespace: kvpool::pool::DEFAULT_NAMESPACE.to_string(),
            token: String::new(),
            client_name: "kvpool-client".into(),
            timeout: Duration::from_secs(10),
            max_idle: 16,
            max_connections: 64,
            max_bulk_connections: 8,
            verify_checksums: true,
            same_host: SameHost::Auto,
            ca: None,
            insecure_skip_verify: false,
            fallback_window: Duration::from_secs(60),
            cluster_secret: None,
            priority: kvpool::protocol::Priority::Normal,
            deadline: None,
            local_index: 65_536,
            connector: None,
        }
    }
}
