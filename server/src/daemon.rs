//! The daemon's lifecycle: build the pool, bind every listener, serve, and on shutdown stop
//! accepting, let in-flight requests finish (bounded by the drain timeout), then release the
//! memory and the socket.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use kvpool::placement::{ClusterView, NodeInfo, NodeState};
use kvpool::protocol::{HelloInfo, PROTOCOL_VERSION};
use kvpool::Pool;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::task::JoinHandle;

use crate::admission::{self, PeerCounts};
use crate::cluster::{self, Membership, Mover, Replication, Source, Timing};
use crate::config::{parse_listen, Config, MembershipConfig};
use crate::deadline::ConnPolicy;
use crate::listeners::{self, Ctx};
use crate::metrics::{self, Metrics};
use crate::peer::PeerAuth;
use crate::service::Shared;
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
    /// Generated or configured TLS certificate (what QUIC clients trust).
    pub tls_cert: Option<PathBuf>,
}

impl Bound {
    /// The line `kvpoold` prints once it is ready, for people and for scripts.
    pub fn ready_line(&self) -> String {
        let show = |a: &Option<SocketAddr>| a.map_or("off".to_string(), |a| a.to_string());
        format!(
            "kvpoold ready tcp={} quic={} metrics={} unix={} resp={}",
            show(&self.tcp),
            show(&self.quic),
            show(&self.metrics),
            self.unix
                .as_ref()
                .map_or("off".to_string(), |p| p.display().to_string()),
            show(&self.resp),
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
    cluster: Arc<Membership>,
    creds: PeerAuth,
    timing: Timing,
    drain_on_shutdown: bool,
    cluster_drain_timeout: Duration,
}

impl Daemon {
    /// Creates the pool and starts every configured listener.
    pub async fn start(config: Config) -> anyhow::Result<Daemon> {
        let data_dir = config.data_dir();
        std::fs::create_dir_all(&data_dir)
            .with_context(|| format!("creating data dir {}", data_dir.display()))?;
        let limits = config.wire_limits()?;
        let hello_limits = config.hello_limits()?;
        let max_connections = connection_cap(&config);
        let membership_cfg = config.membership()?;
        let joins = match &membership_cfg {
            MembershipConfig::Static { peers } => !peers.is_empty(),
            MembershipConfig::Etcd(_) => true,
        };
        let secret = crate::secret::load_or_generate(
            config.cluster.secret_file.as_deref(),
            &data_dir,
            joins,
        )?;
        if secret.generated {
            tracing::info!(
                path = %secret.path.display(),
                "generated a new cluster secret: start the nodes that join this one with --cluster-secret-file pointing at a copy of it"
            );
        } else {
            tracing::info!(path = %secret.path.display(), "cluster secret loaded");
        }
        let creds = PeerAuth {
            token: config.auth.token.clone(),
            secret: secret.secret,
        };
        let pool_cfg = config.pool_config()?;
        let pool =
            Arc::new(Pool::new(&pool_cfg, random_secret()?).context("creating memory segments")?);
        for s in pool.segments() {
            tracing::info!(
                segment = s.layout().id,
                bytes = s.data_len(),
                path = %s.path().map_or("anonymous".into(), |p| p.display().to_string()),
                pages = ?s.page_kind(),
                "segment ready"
            );
        }
        let metrics = Arc::new(Metrics::default());
        let (stop, shutdown) = watch::channel(false);
        let (done_tx, done) = mpsc::channel(1);
        let mut bound = Bound::default();
        let mut tasks = Vec::new();

        let tcp = match parse_listen(&config.listen.tcp)? {
            Some(a) => Some(
                TcpListener::bind(a)
                    .await
                    .with_context(|| format!("binding tcp {a}"))?,
            ),
            None => None,
        };
        bound.tcp = tcp.as_ref().map(|l| l.local_addr()).transpose()?;

        let quic = match parse_listen(&config.listen.quic)? {
            Some(a) => {
                let (certs, key) = tls::load_or_generate(
                    config.tls.cert.as_deref(),
                    config.tls.key.as_deref(),
                    &data_dir,
                )?;
                bound.tls_cert = Some(
                    config
                        .tls
                        .cert
                        .clone()
                        .unwrap_or_else(|| tls::generated_cert_path(&data_dir)),
                );
                let server = tls::quic_server_config(
                    certs,
                    key,
                    config.listen.max_connections.min(u32::MAX as usize) as u32,
                )?;
                let ep = quinn::Endpoint::server(server, a)
                    .with_context(|| format!("binding quic {a}"))?;
                bound.quic = Some(ep.local_addr()?);
                Some(ep)
            }
            None => None,
        };

        let resp = match parse_listen(&config.listen.resp)? {
            Some(a) => Some(
                TcpListener::bind(a)
                    .await
                    .with_context(|| format!("binding resp {a}"))?,
            ),
            None => None,
        };
        bound.resp = resp.as_ref().map(|l| l.local_addr()).transpose()?;

        let unix_path = config.unix_path();
        let unix = bind_unix(&unix_path)?;
        bound.unix = Some(unix_path);

        let metrics_listener = match parse_listen(&config.listen.metrics)? {
            Some(a) => Some(
                TcpListener::bind(a)
                    .await
                    .with_context(|| format!("binding metrics {a}"))?,
            ),
            None => None,
        };
        bound.metrics = metrics_listener
            .as_ref()
            .map(|l| l.local_addr())
            .transpose()?;

        let advertise = match &config.cluster.advertise {
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
        };
        let (in_cluster, source) = match &membership_cfg {
            MembershipConfig::Static { peers } => (!peers.is_empty(), Source::Gossip),
            MembershipConfig::Etcd(_) => (true, Source::Etcd),
        };
        let membership = Arc::new(Membership::new(
            NodeInfo {
                id: config.node_id,
                tcp: advertise,
                quic: bound.quic.map(|a| a.to_string()).unwrap_or_default(),
                metrics: bound.metrics.map(|a| a.to_string()).unwrap_or_default(),
                capacity: pool.stats().capacity(),
                state: if in_cluster {
                    NodeState::Joining
                } else {
                    NodeState::Serving
                },
                epoch: 1,
            },
            source,
        ));
        membership.attach_pool(pool.clone());
        let replication = config.replication(&pool.namespaces());
        let hello = HelloInfo {
            version: PROTOCOL_VERSION,
            node: config.node_id,
            incarnation: pool.incarnation(),
            namespaces: pool.namespaces(),
            host_id: kvpool::segment::host_id(),
            uds_path: bound
                .unix
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            max_payload: limits.max_payload,
            max_batch: limits.max_batch,
            view: ClusterView::default(),
            replication: replication
                .iter()
                .enumerate()
                .map(
                    |(ns, &(replicas, pinned_replicas))| kvpool::protocol::Replication {
                        ns: ns as u32,
                        replicas,
                        pinned_replicas,
                    },
                )
                .collect(),
            challenge: [0; kvpool::protocol::auth::AUTH_LEN],
        };
        let shared = Arc::new(Shared {
            pool: pool.clone(),
            metrics: metrics.clone(),
            limits,
            token: config.auth.token.clone(),
            ns_tokens: config.namespace_tokens(&pool.namespaces()),
            started: Instant::now(),
            hello,
            cluster: membership.clone(),
            cluster_secret: creds.secret.clone(),
            conn: ConnPolicy {
                hello_limits,
                handshake: Duration::from_millis(config.limits.handshake_timeout_ms.max(1)),
                idle: match config.limits.idle_timeout_ms {
                    0 => None,
                    ms => Some(Duration::from_millis(ms)),
                },
                write: Duration::from_millis(config.limits.write_timeout_ms.max(1)),
            },
        });
        let ctx = Ctx {
            shared: shared.clone(),
            limit: Arc::new(Semaphore::new(max_connections)),
            shutdown: shutdown.clone(),
            done: done_tx,
            peers: PeerCounts::new(config.listen.max_connections_per_peer),
        };
        if let Some(l) = tcp {
            tasks.push(tokio::spawn(listeners::tcp(l, ctx.clone())));
        }
        if let Some(ep) = quic {
            tasks.push(tokio::spawn(listeners::quic(ep, ctx.clone())));
        }
        tasks.push(tokio::spawn(listeners::unix(unix, ctx.clone())));
        if let (Some(l), Some(addr)) = (resp, bound.resp) {
            let expiry = Arc::new(crate::resp::Expiry::new(
                config.resp.max_expiring_keys.min(usize::MAX as u64) as usize,
            ));
            let door = Arc::new(crate::resp::RespShared {
                config: config.resp.clone(),
                addr,
                clients: Default::default(),
                next_id: Default::default(),
                expiry: expiry.clone(),
            });
            tasks.push(tokio::spawn(listeners::resp(l, ctx.clone(), door)));
            let (clock, at) = (shared.clone(), shared.clone());
            tasks.push(tokio::spawn(crate::resp::sweeper(
                expiry,
                pool.clone(),
                move || clock.now(),
                move |t| at.instant_at(t),
                shutdown.clone(),
            )));
        }
        drop(ctx);
        if let Some(l) = metrics_listener {
            let mut stop_rx = shutdown.clone();
            tasks.push(tokio::spawn(metrics::serve(
                l,
                metrics,
                pool.clone(),
                config.listen.metrics_namespaces,
                config.auth.token.clone(),
                async move {
                    let _ = stop_rx.wait_for(|s| *s).await;
                },
            )));
        }
        let timing = Timing {
            heartbeat: Duration::from_millis(config.cluster.heartbeat_ms.max(10)),
            down_after: Duration::from_millis(config.cluster.down_after_ms.max(20)),
        };
        tasks.push(match membership_cfg {
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
        });
        let cluster_drain_timeout = Duration::from_millis(config.cluster.drain_timeout_ms);
        tasks.push(tokio::spawn(cluster::mover(
            Mover {
                pool: pool.clone(),
                m: membership.clone(),
                repl: Replication {
                    pinned: replication.iter().map(|r| r.1).collect(),
                },
                creds: creds.clone(),
                timing: timing.clone(),
                started: shared.started,
                drain_timeout: cluster_drain_timeout,
            },
            shutdown.clone(),
        )));
        // The reaper: abandoned allocations go back to the pool.
        let reaper_pool = pool.clone();
        let mut stop_rx = shutdown.clone();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        let n = reaper_pool.reap(shared.started.elapsed().as_millis() as u64);
                        if n > 0 {
                            tracing::info!(reclaimed = n, "reclaimed abandoned allocations");
                        }
                    }
                    _ = stop_rx.wait_for(|s| *s) => return,
                }
            }
        }));
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
            cluster_drain_timeout,
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

    /// Leaves the cluster before a shutdown: when other nodes are serving (and
    /// `cluster.drain_on_shutdown` is on) drains first, moving pinned objects to their owners,
    /// bounded by `cluster.drain_timeout_ms`.
    pub async fn leave(&self) {
        if !self.drain_on_shutdown || !self.cluster.has_serving_peers() {
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
        if self.cluster.my_state() != NodeState::Down && others_see_me {
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
        tracing::info!("kvpoold stopped");
    }
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

fn bind_unix(path: &std::path::Path) -> anyhow::Result<UnixListener> {
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!("another kvpoold is serving on {}", path.display());
        }
        std::fs::remove_file(path)
            .with_context(|| format!("removing stale socket {}", path.display()))?;
    }
    UnixListener::bind(path).with_context(|| format!("binding unix socket {}", path.display()))
}

fn random_secret() -> anyhow::Result<[u8; 16]> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?
        .read_exact(&mut b)
        .context("reading /dev/urandom")?;
    Ok(b)
}
