//! A node served in this process over in-memory streams: the daemon's own connection handler
//! and everything its connections share, built from a [`Config`] as [`crate::Daemon`] builds
//! them, without listeners, sockets or membership traffic. A client reaches it through
//! [`Node::connect`], a stream whose other end the node serves exactly as it serves a TCP
//! connection; tests of clients and of the protocol run against it with no process to start.
//!
//! What a node does not do in-process: accept on sockets, heartbeat, move or hand over objects,
//! export metrics over HTTP, or keep a disk tier (`[disk]`). Its view is changed by the caller instead: [`Node::merge_view`]
//! does what a peer's heartbeat does, [`Node::set_state`] what a drain or a join does to the
//! node's own record, so several nodes in one process form a cluster whose view changes when
//! the caller says. Requests a node makes of other nodes (asking a previous owner for a key
//! while the cluster settles) dial their advertised addresses; an unset `cluster.advertise`
//! is [`Node::default_address`], which no socket listens on, so such a call fails at once and
//! the read is served from what the node holds.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kvpool::placement::{ClusterView, NodeInfo, NodeState};
use kvpool::protocol::auth::ClusterSecret;
use kvpool::Pool;
use tokio::io::DuplexStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::cluster::{Cluster, Source};
use crate::config::Config;
use crate::daemon::{self, Bound};
use crate::handler::{serve, Accepted};
use crate::metrics::{Metrics, Transport};
use crate::peer::PeerAuth;
use crate::service::Shared;

/// Bytes each direction of an in-memory stream buffers before its writer waits for the reader.
const STREAM_BUFFER: usize = 256 << 10;

/// A node served in this process; see the module docs. Dropping it stops its background tasks
/// and closes its streams.
pub struct Node {
    shared: Arc<Shared>,
    address: String,
    /// Stops the background tasks.
    stop: watch::Sender<bool>,
    /// Closes the streams opened so far ([`Node::disconnect_all`]); replaced after each use.
    streams: Mutex<watch::Sender<bool>>,
    /// Streams being served.
    open: Arc<AtomicUsize>,
    tasks: Vec<JoinHandle<()>>,
}

impl Node {
    /// Builds the node's pool, limits, tokens and namespaces from `config` as the daemon does
    /// (`memory.backing = "anonymous"` keeps it off the file system) and starts its background
    /// tasks: reclaiming abandoned allocations, lapsed handoff leases, and trimming the heap.
    /// The node starts serving, alone in its view. Its cluster secret is generated afresh.
    ///
    /// Must be called within a Tokio runtime, which then runs everything the node does.
    pub async fn start(config: Config) -> anyhow::Result<Node> {
        let policy = (daemon::conn_policy(&config)?, config.ledger_bounds()?);
        let pool = daemon::open_pool(&config)?;
        let address = config
            .cluster
            .advertise
            .clone()
            .unwrap_or_else(|| Node::default_address(config.node_id));
        let me = NodeInfo {
            id: config.node_id,
            tcp: address.clone(),
            quic: String::new(),
            metrics: String::new(),
            capacity: pool.stats().capacity(),
            state: NodeState::Serving,
            epoch: 1,
        };
        let cluster = Arc::new(Cluster::new(me, Source::Gossip));
        cluster.attach_pool(pool.clone());
        let secret = ClusterSecret::generate_file_contents()
            .and_then(|s| ClusterSecret::from_file_contents(s.as_bytes()))
            .map_err(|e| anyhow::anyhow!("generating a cluster secret: {e}"))?;
        let metrics = Arc::new(Metrics::default());
        let creds = PeerAuth {
            token: config.auth.token.clone(),
            secret,
            traffic: metrics.peer_traffic(),
        };
        let parts = (&pool, &metrics, &cluster, &creds);
        let shared = Arc::new(daemon::shared(
            &config,
            parts,
            &Bound::default(),
            policy,
            None,
        ));
        let (stop, shutdown) = watch::channel(false);
        let tasks = vec![
            tokio::spawn(crate::trim::run(shared.trim.clone(), shutdown.clone())),
            daemon::start_reaper(pool, shared.started, &shutdown),
            daemon::start_lease_reaper(shared.clone(), &shutdown),
        ];
        Ok(Node {
            shared,
            address,
            stop,
            streams: Mutex::new(watch::channel(false).0),
            open: Arc::default(),
            tasks,
        })
    }

    /// The address a node advertises when `cluster.advertise` is unset: `127.x.y.z:0`, with
    /// `x.y.z` the low 24 bits of its id. A loopback address whose port no socket can listen
    /// on, unique per node id below 2^24: a client's connector can tell the nodes apart by it,
    /// and a dial that leaves the process is refused at once.
    pub fn default_address(node_id: u32) -> String {
        let [_, x, y, z] = node_id.to_be_bytes();
        format!("127.{x}.{y}.{z}:0")
    }

    /// A fresh stream to the node: the node serves the other end as a TCP connection (the
    /// handshake, its limits and timeouts, every operation), until either end closes it,
    /// [`Node::disconnect_all`] closes it, or the node is dropped.
    pub fn connect(&self) -> DuplexStream {
        let (client, server) = tokio::io::duplex(STREAM_BUFFER);
        let shutdown = self
            .streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .subscribe();
        let accepted = Accepted {
            transport: Transport::Tcp,
            peer: None,
            fd: None,
            admit: None,
        };
        let open = Open::count(&self.open);
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let _open = open;
            let (r, w) = tokio::io::split(server);
            serve(shared, accepted, r, w, shutdown).await;
        });
        client
    }

    /// Closes every stream opened so far, as a restarting daemon closes its connections: each
    /// ends once it is idle between requests. Streams opened later are served as usual.
    pub fn disconnect_all(&self) {
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        streams.send_replace(true);
        *streams = watch::channel(false).0;
    }

    /// Streams being served now.
    pub fn open_streams(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// This node's id (`node_id`).
    pub fn id(&self) -> u32 {
        self.shared.cluster.me()
    }

    /// The address this node is known by in views (`cluster.advertise`, else
    /// [`Node::default_address`]).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The pool the node serves.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.shared.pool
    }

    /// The node's current view of the cluster.
    pub fn view(&self) -> ClusterView {
        self.shared.cluster.view()
    }

    /// Merges `other`, another node's view, into this node's, as a heartbeat from that node
    /// does: records newer than this node's win. Returns the view after.
    pub fn merge_view(&self, other: &ClusterView) -> ClusterView {
        self.shared.cluster.merge(other)
    }

    /// Changes this node's own state in its view (raising its record's epoch), as joining,
    /// draining or leaving does; other nodes learn it by [`Node::merge_view`].
    pub fn set_state(&self, state: NodeState) {
        self.shared.cluster.set_state(state);
    }
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("id", &self.id())
            .field("address", &self.address)
            .field("open_streams", &self.open_streams())
            .finish_non_exhaustive()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop.send_replace(true);
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send_replace(true);
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// One stream being served, counted in [`Node::open_streams`] while it lives.
struct Open(Arc<AtomicUsize>);

impl Open {
    fn count(open: &Arc<AtomicUsize>) -> Open {
        open.fetch_add(1, Ordering::AcqRel);
        Open(open.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
