//! The daemon's lifecycle: build the pool, bind every listener, serve, and on shutdown stop
//! accepting, let in-flight requests finish (bounded by the drain timeout), then release the
//! memory and the socket.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use kvpool::placement::{ClusterView, NodeInfo, NodeState};
use kvpool::protocol::{HelloInfo, Limits, PROTOCOL_VERSION};
use kvpool::Pool;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::task::JoinHandle;

use crate::admission::{self, PeerCounts};
use crate::cluster::{self, Cluster, Source, Timing};
use crate::config::{parse_listen, Config, MembershipConfig};
use crate::deadline::ConnPolicy;
use crate::disk_tier::DiskTier;
use crate::listeners::{self, Ctx};
use crate::metrics::{self, Metrics};
use crate::mover::{self, Mover, Replication};
use crate::peer::PeerAuth;
use crate::service::{Auth, PeerPolicy, Shared};
use crate::tls;

/// The addresses a running daemon actually bound (port 0 in the config picks a free port).
#[derive(Clone, Debug, Default)]
pub struct Bound {
    /// TCP listener.
    pub tcp: Option<SocketAddr>,
    /// QUIC endpoint.
    pub quic: Option<SocketAddr>,
    /// Metrics HTTP listener.
    pub metrics: Option<SocketAddr>,
    /// Unix socket.
    pub unix: Option<PathBuf>,
    /// The Redis-protocol front door (`listen.resp`).
    pub resp: Option<SocketAddr>,
    /// The native protocol over TLS (`listen.tls`).
    pub tls: Option<SocketAddr>,
    /// Generated or configured TLS certificate (what QUIC and TLS clients trust).
    pub tls_cert: Option<PathBuf>,
}

impl Bound {
    /// The line `kvpoold` prints once it is ready, for people and for scripts.
    pub fn ready_line(&self) -> String {
        let show = |a: &Option<SocketAddr>| a.map_or("off".to_string(), |a| a.to_string());
        format!(
            "kvpoold ready tcp={} quic={} metrics={} unix={} resp={} tls={}",
            show(&self.tcp),
            show(&self.quic),
            show(&self.metrics),
            self.unix
                .as_ref()
                .map_or("off".to_string(), |p| p.display().to_string()),
            show(&self.resp),
            show(&self.tls),
        )
    }
}

/// A running daemon.
pub struct Daemon {
    bound: Bound,
    pool: Arc<Pool>,
    stop: watch::Sender<bool>,
    done: mpsc::Receiver<()>,
    tasks: Vec<JoinHandle<()>>,
    drain_timeout: Duration,
    cluster: Arc<Cluster>,
    creds: PeerAuth,
    timing: Timing,
    drain_on_shutdown: bool,
    /// `[cluster] restart_on_shutdown`, with segments that a restart recovers (files).
    restart_on_shutdown: bool,
    /// The segments are files a restart recovers (`memory.backing = "shm"`).
    recovers: bool,
    cluster_drain_timeout: Duration,
    /// The disk tier under DRAM, when `[disk]` turns it on.
    disk: Option<Arc<DiskTier>>,
    /// Where the segments, the journal and a restart's note live.
    data_dir: PathBuf,
}

impl Daemon {
    /// Creates the pool and starts every configured listener, in named steps: load the cluster
    /// credentials, open the segments (`open_pool`), bind the listeners (`Sockets::bind`),
    /// take this node's place in the cluster (`membership`), serve (`serve`), then start the
    /// background tasks (`join_cluster`, `start_mover`, `start_reaper`).
    pub async fn start(config: Config) -> anyhow::Result<Daemon> {
        let data_dir = config.data_dir();
        // Other users may reach the socket by its name (`listen.unix_mode`), never list the
        // directory; every file in it is the daemon user's alone (0600).
        kvpool::segment::create_dir(&data_dir)
            .with_context(|| format!("creating data dir {}", data_dir.display()))?;
        let policy = (conn_policy(&config)?, config.ledger_bounds()?);
        let max_connections = connection_cap(&config);
        let membership_cfg = config.membership()?;
        let disk_settings = config.disk_tier()?;
        let metrics = Arc::new(Metrics::default());
        let creds = credentials(&config, &membership_cfg, &data_dir, &metrics)?;
        let pool = open_pool(&config)?;
        let disk = disk_settings.map(|d| DiskTier::open(&d)).transpose()?;
        if let Some(d) = &disk {
            d.attach(&pool)?;
        }
        let sockets = Sockets::bind(&config, &data_dir).await?;
        let bound = sockets.bound.clone();
        let timing = Timing {
            heartbeat: Duration::from_millis(config.cluster.heartbeat_ms.max(10)),
            down_after: Duration::from_millis(config.cluster.down_after_ms.max(20)),
            restart_window: Duration::from_millis(
                config
                    .cluster
                    .restart_window_ms
                    .max(config.cluster.down_after_ms.max(20)),
            ),
        };
        let recovers = config.memory.backing != "anonymous";
        let departed = recovers
            .then(|| crate::restart::take_note(&data_dir, config.node_id, timing.restart_window))
            .flatten();
        let membership = membership(&config, (&membership_cfg, departed, &timing), &bound, &pool);
        let parts = (&pool, &metrics, &membership, &creds);
        let mut shared = shared(&config, parts, &bound, policy, disk.clone());
        if !config.listen.fabric.is_empty() {
            let fabric = crate::fabric::NodeFabric::open(&config.listen.fabric, &pool)?;
            metrics.fabric_registered(fabric.registered_bytes());
            shared.fabric = Some(Arc::new(fabric));
        }
        let shared = Arc::new(shared);
        let (stop, shutdown) = watch::channel(false);
        let (done_tx, done) = mpsc::channel(1);
        let ctx = Ctx {
            shared: shared.clone(),
            limit: Arc::new(Semaphore::new(max_connections)),
            shutdown: shutdown.clone(),
            done: done_tx,
            peers: PeerCounts::new(config.listen.max_connections_per_peer),
            reaper: crate::reaper::Reaper::new(),
        };
        let mut tasks = serve(sockets, ctx, &config, metrics);
        let cluster_drain_timeout = Duration::from_millis(config.cluster.drain_timeout_ms);
        tasks.push(join_cluster(
            membership_cfg,
            &membership,
            &creds,
            &timing,
            &shutdown,
        ));
        let mover = (creds.clone(), timing.clone(), cluster_drain_timeout);
        let handover = config.cluster.handover.then(|| crate::handover::Budget {
            replicas: shared
                .hello
                .replication
                .iter()
                .map(|r| r.replicas)
                .collect(),
            max_bytes: config.cluster.handover_max_bytes,
        });
        tasks.push(start_mover(&shared, mover, handover, &shutdown));
        tasks.push(start_reaper(pool.clone(), shared.started, &shutdown));
        tasks.push(start_lease_reaper(shared.clone(), &shutdown));
        tasks.push(start_view_gauge(&shared, &shutdown));
        Ok(Daemon {
            bound,
            pool,
            stop,
            done,
            tasks,
            drain_timeout: Duration::from_millis(config.drain_timeout_ms),
            cluster: membership,
            creds,
            timing,
            drain_on_shutdown: config.cluster.drain_on_shutdown,
            restart_on_shutdown: config.cluster.restart_on_shutdown && recovers,
            recovers,
            cluster_drain_timeout,
            disk,
            data_dir,
        })
    }

    /// This node's current cluster view.
    pub fn view(&self) -> ClusterView {
        self.cluster.view()
    }

    /// Resolves once the node has drained and left the cluster (after a `Drain` request); the
    /// process should then shut down.
    pub async fn left(&self) {
        self.cluster.left().await
    }

    /// Leaves the cluster before a shutdown: when other nodes are serving and this one serves,
    /// with `cluster.restart_on_shutdown` tells them it is restarting in place (it keeps its
    /// keys; see `server/src/restart.rs`); else, with `cluster.drain_on_shutdown`, drains first,
    /// moving pinned objects to their owners, bounded by `cluster.drain_timeout_ms`.
    pub async fn leave(&self) {
        if !self.cluster.has_serving_peers() {
            return;
        }
        if self.restart_on_shutdown && self.cluster.my_state() == NodeState::Serving {
            self.cluster.set_state(NodeState::Restarting);
            cluster::announce(&self.cluster, &self.creds, self.timing.heartbeat * 2).await;
            tracing::info!(
                window_ms = self.timing.restart_window.as_millis() as u64,
                "restarting in place: the cluster holds this node's keys for it"
            );
            return;
        }
        if !self.drain_on_shutdown {
            return;
        }
        self.cluster.request_drain();
        let bound = self.cluster_drain_timeout + self.timing.heartbeat * 20;
        if tokio::time::timeout(bound, self.cluster.left())
            .await
            .is_err()
        {
            tracing::warn!("drain did not finish in time");
        }
    }

    /// What was bound.
    pub fn bound(&self) -> &Bound {
        &self.bound
    }

    /// The pool (for in-process use and tests).
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Stops accepting, waits for in-flight requests (up to the drain timeout), then releases
    /// everything.
    pub async fn shutdown(mut self) {
        let others_see_me =
            self.cluster.view().nodes.len() > 1 || self.cluster.source() == Source::Etcd;
        let restarting = self.cluster.my_state() == NodeState::Restarting;
        if !restarting && self.cluster.my_state() != NodeState::Down && others_see_me {
            // Tell the peers (or etcd) at once instead of letting them time out.
            self.cluster.set_state(NodeState::Down);
            cluster::announce(&self.cluster, &self.creds, self.timing.heartbeat * 2).await;
        }
        let _ = self.stop.send(true);
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
        // Every connection task holds a sender; recv() returns None once all are gone.
        if tokio::time::timeout(self.drain_timeout, self.done.recv())
            .await
            .is_err()
        {
            tracing::warn!("drain timeout: closing with requests still in flight");
        }
        if let Some(p) = &self.bound.unix {
            let _ = std::fs::remove_file(p);
        }
        if let Some(d) = self.disk.clone() {
            // What is on its way to disk gets the drain's time to land there, so that a restart
            // finds it; past that it is lost, as a cache's demotions may be.
            let within = self.drain_timeout;
            let finished = tokio::task::spawn_blocking(move || d.finish(within)).await;
            if !matches!(finished, Ok(true)) {
                tracing::warn!("the disk tier's last demotions were not all written before exit");
            }
        }
        if self.recovers {
            // Nothing writes the pool any more: its policies' order, for the next life to
            // recover the objects in (see `kvpool::pool::recency`).
            match self.pool.save_recency(&self.data_dir) {
                Ok(n) => tracing::debug!(objects = n, "saved the eviction order for a restart"),
                Err(e) => {
                    tracing::warn!(error = %e, "could not save the eviction order: a restart recovers in commit order")
                }
            }
        }
        if restarting {
            // Written last: every request this process acknowledged is in the journal by now.
            let view = self.cluster.view();
            let (me, window) = (self.cluster.me(), self.timing.restart_window);
            if let Err(e) = crate::restart::leave_note(&self.data_dir, me, &view, window) {
                tracing::warn!(error = %e, "could not leave the restart note: the next start joins afresh");
            }
        }
        tracing::info!("kvpoold stopped");
    }
}

/// The cluster secret (loaded, or generated when this node starts a cluster alone) and the
/// client token, with which this node proves itself to its peers.
fn credentials(
    config: &Config,
    membership: &MembershipConfig,
    data_dir: &Path,
    metrics: &Metrics,
) -> anyhow::Result<PeerAuth> {
    let joins = match membership {
        MembershipConfig::Static { peers } => !peers.is_empty(),
        MembershipConfig::Etcd(_) => true,
    };
    let secret =
        crate::secret::load_or_generate(config.cluster.secret_file.as_deref(), data_dir, joins)?;
    if secret.generated {
        tracing::info!(
            path = %secret.path.display(),
            "generated a new cluster secret: start the nodes that join this one with --cluster-secret-file pointing at a copy of it"
        );
    } else {
        tracing::info!(path = %secret.path.display(), "cluster secret loaded");
    }
    Ok(PeerAuth {
        token: config.auth.token.clone(),
        secret: secret.secret,
        traffic: metrics.peer_traffic(),
    })
}

/// Opens the memory segments and builds the pool over them.
pub(crate) fn open_pool(config: &Config) -> anyhow::Result<Arc<Pool>> {
    let pool_cfg = config.pool_config()?;
    let started = std::time::Instant::now();
    let pool =
        Arc::new(Pool::new(&pool_cfg, random_secret()?).context("creating memory segments")?);
    let r = pool.recovery();
    if let Some(why) = &r.unreadable {
        tracing::warn!(
            %why,
            "the previous life's journal is not readable by this kvpoold: starting empty"
        );
    } else if r.listed > 0 || r.torn_tail > 0 {
        let dropped =
            r.dropped_checksum + r.dropped_bounds + r.dropped_namespace + r.dropped_no_room;
        tracing::info!(
            listed = r.listed,
            recovered = r.recovered,
            recovered_bytes = r.recovered_bytes,
            dropped_checksum = r.dropped_checksum,
            dropped_bounds = r.dropped_bounds,
            dropped_namespace = r.dropped_namespace,
            dropped_no_room = r.dropped_no_room,
            torn_tail = r.torn_tail,
            millis = started.elapsed().as_millis() as u64,
            "recovered the previous life's objects ({dropped} dropped)"
        );
    }
    if !config.memory.prefault {
        pool.start_prefaulting(config.memory.prefault_ahead)
            .context("starting the prefaulting thread")?;
    }
    for s in pool.segments() {
        tracing::info!(
            segment = s.layout().id,
            bytes = s.data_len(),
            path = %s.path().map_or("anonymous".into(), |p| p.display().to_string()),
            pages = ?s.page_kind(),
            "segment ready"
        );
    }
    Ok(pool)
}

/// Every configured listener, bound but not yet accepting.
struct Sockets {
    tcp: Option<TcpListener>,
    quic: Option<quinn::Endpoint>,
    unix: UnixListener,
    metrics: Option<TcpListener>,
    /// The Redis-protocol front door.
    resp: Option<TcpListener>,
    /// The native protocol over TLS.
    tls: Option<(TcpListener, tokio_rustls::TlsAcceptor)>,
    /// What they bound.
    bound: Bound,
}

impl Sockets {
    /// Binds TCP, QUIC (loading or generating its certificate in `data_dir`), the Unix socket,
    /// the metrics listener and the RESP front door, as configured.
    async fn bind(config: &Config, data_dir: &Path) -> anyhow::Result<Sockets> {
        let mut bound = Bound::default();
        let tcp = bind_tcp(&config.listen.tcp, "tcp").await?;
        bound.tcp = tcp.as_ref().map(|l| l.local_addr()).transpose()?;
        let quic_at = parse_listen(&config.listen.quic)?;
        let tls_at = parse_listen(&config.listen.tls)?;
        let material = if quic_at.is_some() || tls_at.is_some() {
            bound.tls_cert = Some(
                config
                    .tls
                    .cert
                    .clone()
                    .unwrap_or_else(|| tls::generated_cert_path(data_dir)),
            );
            Some(tls::load_or_generate(
                config.tls.cert.as_deref(),
                config.tls.key.as_deref(),
                data_dir,
            )?)
        } else {
            None
        };
        let copy = |m: &Option<(Vec<_>, rustls::pki_types::PrivateKeyDer<'static>)>| {
            m.as_ref().map(|(c, k)| (c.clone(), k.clone_key()))
        };
        let quic = match (quic_at, copy(&material)) {
            (Some(a), Some((certs, key))) => {
                let max_streams = config.listen.max_connections.min(u32::MAX as usize) as u32;
                let server = tls::quic_server_config(certs, key, max_streams)?;
                let ep = quinn::Endpoint::server(server, a)
                    .with_context(|| format!("binding quic {a}"))?;
                bound.quic = Some(ep.local_addr()?);
                Some(ep)
            }
            _ => None,
        };
        let tls = match (tls_at, material) {
            (Some(a), Some((certs, key))) => {
                let server = tls::tcp_server_config(certs, key)?;
                let l = TcpListener::bind(a)
                    .await
                    .with_context(|| format!("binding tls {a}"))?;
                bound.tls = Some(l.local_addr()?);
                Some((l, tokio_rustls::TlsAcceptor::from(Arc::new(server))))
            }
            _ => None,
        };
        let resp = bind_tcp(&config.listen.resp, "resp").await?;
        bound.resp = resp.as_ref().map(|l| l.local_addr()).transpose()?;
        let unix_path = config.unix_path();
        let unix = bind_unix(&unix_path, config.listen.unix_mode)?;
        bound.unix = Some(unix_path);
        let metrics = bind_tcp(&config.listen.metrics, "metrics").await?;
        bound.metrics = metrics.as_ref().map(|l| l.local_addr()).transpose()?;
        Ok(Sockets {
            tcp,
            quic,
            unix,
            metrics,
            resp,
            tls,
            bound,
        })
    }
}

/// Binds a TCP listener at `spec` (`what` names it in errors), or none when it is off.
async fn bind_tcp(spec: &str, what: &str) -> anyhow::Result<Option<TcpListener>> {
    match parse_listen(spec)? {
        Some(a) => Ok(Some(
            TcpListener::bind(a)
                .await
                .with_context(|| format!("binding {what} {a}"))?,
        )),
        None => Ok(None),
    }
}

/// Where other nodes and clients reach this node over TCP: `cluster.advertise`, else the bound
/// TCP address (loopback in place of an unspecified one), else nothing.
fn advertise(config: &Config, bound: &Bound) -> String {
    match &config.cluster.advertise {
        Some(a) => a.clone(),
        None => match bound.tcp {
            Some(a) if a.ip().is_unspecified() => {
                tracing::warn!(
                    "TCP is bound to {a}: other nodes and clients reach this node at \
                     127.0.0.1:{}; set cluster.advertise for other hosts",
                    a.port()
                );
                format!("127.0.0.1:{}", a.port())
            }
            Some(a) => a.to_string(),
            None => String::new(),
        },
    }
}

/// This node's membership: its own record (`Joining` when it has peers or etcd to join,
/// `Serving` alone) and where views come from, with the pool attached; or, when the previous
/// process on this data directory left for a restart in place (`departed`), that process's
/// view to resume from (see [`crate::restart`]).
fn membership(
    config: &Config,
    (membership, departed, timing): (&MembershipConfig, Option<crate::restart::Departed>, &Timing),
    bound: &Bound,
    pool: &Arc<Pool>,
) -> Arc<Cluster> {
    let (in_cluster, source) = match membership {
        MembershipConfig::Static { peers } => (!peers.is_empty(), Source::Gossip),
        MembershipConfig::Etcd(_) => (true, Source::Etcd),
    };
    let me = NodeInfo {
        id: config.node_id,
        tcp: advertise(config, bound),
        quic: bound.quic.map(|a| a.to_string()).unwrap_or_default(),
        metrics: bound.metrics.map(|a| a.to_string()).unwrap_or_default(),
        capacity: pool.stats().capacity(),
        state: if in_cluster {
            NodeState::Joining
        } else {
            NodeState::Serving
        },
        epoch: 1,
    };
    let resumed = departed.and_then(|d| {
        let joining = NodeInfo {
            state: NodeState::Joining,
            ..me.clone()
        };
        let window = (d.remaining, timing.down_after);
        Cluster::resuming(d.view, joining, source, window)
    });
    let membership = Arc::new(match resumed {
        Some(c) => {
            tracing::info!("resuming a restart in place: waiting for the cluster's records");
            c
        }
        None => Cluster::new(me, source),
    });
    membership.attach_pool(pool.clone());
    membership
}

/// What every connection shares: the pool, the limits and timeouts, the tokens, and the
/// `Hello` a client is told (its view filled in per connection).
pub(crate) fn shared(
    config: &Config,
    (pool, metrics, membership, creds): (&Arc<Pool>, &Arc<Metrics>, &Arc<Cluster>, &PeerAuth),
    bound: &Bound,
    (conn, bounds): (ConnPolicy, crate::ledger::Bounds),
    disk: Option<Arc<DiskTier>>,
) -> Shared {
    let namespaces = pool.namespaces();
    let capacities: Vec<u64> = (0..namespaces.len() as u32)
        .map(|ns| pool.namespace_capacity(ns).unwrap_or(0))
        .collect();
    let ledger = crate::ledger::Ledger::new(&bounds, &capacities);
    let trim: Arc<crate::trim::Trim> = Default::default();
    let hello = hello_info(config, pool, bound, &conn.limits);
    let watches = Arc::new(crate::watch::Watches::new(
        config.limits.tombstone_ms,
        ledger.clone(),
        trim.clone(),
    ));
    let events = crate::events::EventHub::new(namespaces.len(), metrics.event_series());
    pool.observe(Arc::new(crate::events::Observers {
        watches: watches.clone(),
        events: events.clone(),
    }));
    if let Some(d) = &disk {
        d.publish_to(events.clone());
    }
    Shared {
        pool: pool.clone(),
        metrics: metrics.clone(),
        started: Instant::now(),
        hello,
        cluster: membership.clone(),
        conn,
        watches,
        events,
        bulk: Arc::new(crate::bulk::Bulk::new(bulk_config(config, &namespaces))),
        trim,
        stagings: crate::staging::Stagings::new(
            (config.memory.staging, config.memory.staging_total),
            ledger.clone(),
            metrics.staging_gauge(),
        ),
        ledger,
        auth: Auth {
            token: config.auth.token.clone(),
            ns_tokens: config.namespace_tokens(&namespaces),
            ns_read_tokens: config.namespace_read_tokens(&namespaces),
            failures: crate::auth_limit::AuthFailures::new(
                config.limits.auth_failures,
                Duration::from_millis(config.limits.auth_failure_refill_ms),
                config.limits.auth_failures_per_second,
            ),
            per_token: crate::admission::TokenCounts::new(
                config.limits.max_connections_per_token as usize,
            ),
        },
        peers: PeerPolicy {
            secret: creds.secret.clone(),
            // No per-address allowance: nodes often share an address (containers behind one,
            // nodes on one host), and a wrong node's heartbeats must not lock out the right ones.
            failures: crate::auth_limit::AuthFailures::new(
                0,
                Duration::from_millis(config.limits.auth_failure_refill_ms),
                config.limits.cluster_auth_failures_per_second,
            ),
            timeout: Duration::from_millis(config.cluster.heartbeat_ms.max(10)) * 4,
        },
        disk,
        fabric: None,
    }
}

/// The `Hello` a client is told: this node, its namespaces and limits, the same-host socket;
/// the view and the challenge are filled in per connection.
fn hello_info(config: &Config, pool: &Pool, bound: &Bound, limits: &Limits) -> HelloInfo {
    let namespaces = pool.namespaces();
    let replication = config
        .replication(&namespaces)
        .iter()
        .enumerate()
        .map(
            |(ns, &(replicas, pinned_replicas))| kvpool::protocol::Replication {
                ns: ns as u32,
                replicas,
                pinned_replicas,
            },
        )
        .collect();
    HelloInfo {
        version: PROTOCOL_VERSION,
        node: config.node_id,
        incarnation: pool.incarnation(),
        namespaces: namespaces.clone(),
        host_id: kvpool::segment::host_id(),
        uds_path: bound
            .unix
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        max_payload: limits.max_payload,
        max_batch: limits.max_batch,
        view: ClusterView::default(),
        replication,
        challenge: [0; kvpool::protocol::auth::AUTH_LEN],
    }
}

/// How bulk transfers are scheduled (`[limits] bulk_*`, `[[namespace]] bulk_rate`).
fn bulk_config(config: &Config, namespaces: &[(String, u32)]) -> crate::bulk::BulkConfig {
    let l = &config.limits;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Left to the default, one core is kept for small requests, and bulk takes it too while
    // none comes (spare turns); a count set by hand is a cap.
    let (workers, spare) = match l.bulk_workers {
        0 => {
            let workers = cores.saturating_sub(1).max(1);
            (workers, cores.saturating_sub(workers))
        }
        n => (n as usize, 0),
    };
    crate::bulk::BulkConfig {
        workers,
        spare,
        quiet: crate::bulk::QUIET,
        rate: Some(l.bulk_rate).filter(|&r| r > 0),
        ns_rates: config.bulk_rates(namespaces),
        threshold: l.bulk_threshold.max(1),
        hold: Duration::from_millis(l.bulk_hold_ms.max(1)),
        chunk: crate::handler::BULK_CHUNK as u64,
    }
}

/// The limits before and after the handshake and the timeouts of every stage of a connection.
pub(crate) fn conn_policy(config: &Config) -> anyhow::Result<ConnPolicy> {
    let limits = config.wire_limits()?;
    crate::staging::check_setting(&config.memory.same_host_writes)?;
    Ok(ConnPolicy {
        limits,
        hello_limits: config.hello_limits()?,
        handshake: Duration::from_millis(config.limits.handshake_timeout_ms.max(1)),
        idle: match config.limits.idle_timeout_ms {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        },
        write: Duration::from_millis(config.limits.write_timeout_ms.max(1)),
        read: Duration::from_millis(config.limits.read_timeout_ms.max(1)),
    })
}

/// Starts accepting on every bound listener (connections get `ctx`), and the metrics page.
fn serve(
    sockets: Sockets,
    ctx: Ctx,
    config: &Config,
    metrics: Arc<Metrics>,
) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    if let Some(l) = sockets.tcp {
        tasks.push(tokio::spawn(listeners::tcp(l, ctx.clone())));
    }
    if let Some(ep) = sockets.quic {
        tasks.push(tokio::spawn(listeners::quic(ep, ctx.clone())));
    }
    if let Some((l, acceptor)) = sockets.tls {
        tasks.push(tokio::spawn(listeners::tls(l, acceptor, ctx.clone())));
    }
    if let (Some(l), Some(addr)) = (sockets.resp, sockets.bound.resp) {
        tasks.extend(serve_resp(l, addr, &ctx, config));
    }
    tasks.push(tokio::spawn(crate::trim::run(
        ctx.shared.trim.clone(),
        ctx.shutdown.clone(),
    )));
    let mut stop_rx = ctx.shutdown.clone();
    let observed = (
        ctx.shared.pool.clone(),
        ctx.shared.ledger.clone(),
        ctx.shared.disk.clone(),
        ctx.shared.cluster.clone(),
    );
    tasks.push(tokio::spawn(listeners::unix(sockets.unix, ctx)));
    if let Some(l) = sockets.metrics {
        tasks.push(tokio::spawn(metrics::serve(
            l,
            metrics,
            observed,
            config.listen.metrics_namespaces,
            config.auth.token.clone(),
            async move {
                let _ = stop_rx.wait_for(|s| *s).await;
            },
        )));
    }
    tasks
}

/// The RESP front door on `l` (bound at `addr`), and the sweeper that expires what its
/// clients set with `EX`/`PX`.
fn serve_resp(l: TcpListener, addr: SocketAddr, ctx: &Ctx, config: &Config) -> [JoinHandle<()>; 2] {
    let expiry = Arc::new(crate::resp::Expiry::new(
        config.resp.max_expiring_keys.min(usize::MAX as u64) as usize,
    ));
    let door = Arc::new(crate::resp::RespShared {
        config: config.resp.clone(),
        addr,
        clients: Default::default(),
        next_id: Default::default(),
        expiry: expiry.clone(),
        forward: crate::resp::Forwarder::new(
            config.auth.token.clone(),
            std::time::Duration::from_millis(config.limits.write_timeout_ms),
        ),
        weights_memory: crate::resp::WeightsBudget::new(config.resp.weights_memory),
        input_memory: crate::resp::InputMemory::new(config.resp.input_memory),
    });
    let (clock, at) = (ctx.shared.clone(), ctx.shared.clone());
    [
        tokio::spawn(listeners::resp(l, ctx.clone(), door)),
        tokio::spawn(crate::resp::sweeper(
            expiry,
            ctx.shared.pool.clone(),
            move || clock.now(),
            move |t| at.instant_at(t),
            ctx.shutdown.clone(),
        )),
    ]
}

/// Keeps this node's place in the cluster: heartbeats with the static peers, or etcd's leases
/// and watch.
fn join_cluster(
    config: MembershipConfig,
    membership: &Arc<Cluster>,
    creds: &PeerAuth,
    timing: &Timing,
    shutdown: &watch::Receiver<bool>,
) -> JoinHandle<()> {
    match config {
        MembershipConfig::Static { peers } => tokio::spawn(cluster::heartbeats(
            membership.clone(),
            peers,
            creds.clone(),
            timing.clone(),
            shutdown.clone(),
        )),
        MembershipConfig::Etcd(etcd) => tokio::spawn(crate::etcd_gateway::run(
            membership.clone(),
            etcd,
            timing.clone(),
            shutdown.clone(),
        )),
    }
}

/// Moves pinned objects to their owners, and hands unpinned ones over (`handover`), when the
/// view changes or this node drains (within `drain_timeout`), proving itself to them with
/// `creds`.
fn start_mover(
    shared: &Shared,
    (creds, timing, drain_timeout): (PeerAuth, Timing, Duration),
    handover: Option<crate::handover::Budget>,
    shutdown: &watch::Receiver<bool>,
) -> JoinHandle<()> {
    let pinned = shared.hello.replication.iter();
    let mover = Mover {
        pool: shared.pool.clone(),
        bulk: shared.bulk.clone(),
        m: shared.cluster.clone(),
        repl: Replication {
            pinned: pinned.map(|r| r.pinned_replicas).collect(),
        },
        creds,
        timing,
        started: shared.started,
        drain_timeout,
        handover,
        metrics: shared.metrics.clone(),
    };
    tokio::spawn(mover::run(mover, shutdown.clone()))
}

/// Every second, gives allocations abandoned past their deadline back to the pool.
pub(crate) fn start_reaper(
    pool: Arc<Pool>,
    started: Instant,
    shutdown: &watch::Receiver<bool>,
) -> JoinHandle<()> {
    let mut stop_rx = shutdown.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let n = pool.reap(started.elapsed().as_millis() as u64);
                    if n > 0 {
                        tracing::info!(reclaimed = n, "reclaimed abandoned allocations");
                    }
                }
                _ = stop_rx.wait_for(|s| *s) => return,
            }
        }
    })
}

/// Keeps the metrics' count of the cluster view's nodes by state (`kvpool_cluster_nodes`) in
/// step with every change of the view.
fn start_view_gauge(shared: &Shared, shutdown: &watch::Receiver<bool>) -> JoinHandle<()> {
    let (cluster, metrics) = (shared.cluster.clone(), shared.metrics.clone());
    let mut stop_rx = shutdown.clone();
    let mut changed = cluster.subscribe();
    tokio::spawn(async move {
        loop {
            metrics.cluster_view(&cluster.view());
            tokio::select! {
                r = changed.changed() => if r.is_err() { return },
                _ = stop_rx.wait_for(|s| *s) => return,
            }
        }
    })
}

/// Removes the objects whose handoff lease (`Expire`) lapsed, ten times a second.
pub(crate) fn start_lease_reaper(
    shared: Arc<Shared>,
    shutdown: &watch::Receiver<bool>,
) -> JoinHandle<()> {
    let mut stop_rx = shutdown.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let lapsed = shared.watches.lapsed(shared.now());
                    let n = lapsed.len() as u64;
                    if n > 0 {
                        shared.metrics.handoff_failed(crate::metrics::HandoffFailure::Lapsed, n);
                    }
                    for (ns, key) in lapsed {
                        // Noted as a remove, as every removal is (Shared::remove): a previous
                        // owner's copy must not be vouched for after it.
                        let _ = shared.remove(ns, &key);
                    }
                }
                _ = stop_rx.wait_for(|s| *s) => return,
            }
        }
    })
}

/// Raises the open-file limit as far as allowed and fits `max_connections` under it, keeping
/// `reserve_fds` for everything else.
fn connection_cap(config: &Config) -> usize {
    let configured = config.listen.max_connections.max(1);
    let fds = match admission::raise_fd_limit() {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(error = %e, "could not read or raise the open-file limit");
            return configured;
        }
    };
    let cap = admission::connection_cap(configured, fds, config.listen.reserve_fds);
    if cap < configured {
        tracing::warn!(
            open_files = fds,
            reserve = config.listen.reserve_fds,
            "listen.max_connections lowered from {configured} to {cap} to fit the open-file limit"
        );
    }
    cap
}

/// Binds the Unix socket at `path` with permission bits `mode` (`listen.unix_mode`).
fn bind_unix(path: &std::path::Path, mode: u32) -> anyhow::Result<UnixListener> {
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!("another kvpoold is serving on {}", path.display());
        }
        std::fs::remove_file(path)
            .with_context(|| format!("removing stale socket {}", path.display()))?;
    }
    let l = UnixListener::bind(path)
        .with_context(|| format!("binding unix socket {}", path.display()))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of unix socket {}", path.display()))?;
    Ok(l)
}

fn random_secret() -> anyhow::Result<[u8; 16]> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?
        .read_exact(&mut b)
        .context("reading /dev/urandom")?;
    Ok(b)
}

#[cfg(test)]
mod tests;
