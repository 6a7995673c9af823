//! `kvpoold`: the kvpool cache daemon. `kvpoold` alone starts one node on the embedded
//! defaults (1 GiB in /dev/shm, TCP 127.0.0.1:7370, QUIC 7371, metrics 7372, Unix socket in
//! the data dir). Precedence: flags, then `KVPOOL_*` environment variables, then the file.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use kvpool_server::config::{parse_rate, parse_size, Config, DiskAdmit};
use kvpool_server::Daemon;
use tracing_subscriber::EnvFilter;

#[derive(Parser, Debug)]
#[command(
    name = "kvpoold",
    version,
    about = "kvpool cache daemon: contributes DRAM to a shared memory pool for LLM serving"
)]
struct Cli {
    /// TOML configuration file.
    #[arg(short, long, env = "KVPOOL_CONFIG")]
    config: Option<PathBuf>,
    /// Node id, unique in the cluster [default: 0].
    #[arg(long, env = "KVPOOL_NODE_ID")]
    node_id: Option<u32>,
    /// Directory for segment files, the Unix socket and TLS material [default: /dev/shm/kvpool-<node>].
    #[arg(long, env = "KVPOOL_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Memory per segment, e.g. 1GiB, 512MiB [default: 1GiB].
    #[arg(long, env = "KVPOOL_MEMORY")]
    memory: Option<String>,
    /// Number of segments [default: 1].
    #[arg(long, env = "KVPOOL_SEGMENTS")]
    segments: Option<u32>,
    /// Segment backing: shm or anonymous [default: shm].
    #[arg(long, env = "KVPOOL_BACKING")]
    backing: Option<String>,
    /// Huge pages: auto or off [default: auto].
    #[arg(long, env = "KVPOOL_HUGE_PAGES")]
    huge_pages: Option<String>,
    /// TCP listen address; empty disables [default: 127.0.0.1:7370].
    #[arg(long, env = "KVPOOL_TCP")]
    tcp: Option<String>,
    /// QUIC listen address; empty disables [default: 127.0.0.1:7371].
    #[arg(long, env = "KVPOOL_QUIC")]
    quic: Option<String>,
    /// Metrics HTTP address; empty disables [default: 127.0.0.1:7372].
    #[arg(long, env = "KVPOOL_METRICS")]
    metrics: Option<String>,
    /// Unix socket path [default: <data-dir>/kvpool.sock].
    #[arg(long, env = "KVPOOL_UNIX")]
    unix: Option<PathBuf>,
    /// Redis-protocol (RESP) listen address, e.g. 127.0.0.1:6380; empty disables [default: off].
    #[arg(long, env = "KVPOOL_RESP")]
    resp: Option<String>,
    /// TLS-over-TCP listen address for the native protocol (clients: tls://host:port), with
    /// QUIC's certificate; empty disables [default: off].
    #[arg(long, env = "KVPOOL_TLS")]
    tls: Option<String>,
    /// libfabric provider the segments are registered with for one-sided reads (clients:
    /// fabric://host:port, the TCP address): tcp, shm, "verbs;ofi_rxm", efa; empty disables
    /// [default: off].
    #[arg(long, env = "KVPOOL_FABRIC")]
    fabric: Option<String>,
    /// Auth token clients must present [default: none].
    #[arg(long, env = "KVPOOL_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Another node's TCP address to heartbeat (static membership); repeat for several.
    #[arg(long = "peer", env = "KVPOOL_PEERS", value_delimiter = ',')]
    peers: Vec<String>,
    /// etcd client URL (http://host:port or https://host:port) for membership instead of
    /// peers; repeat for several.
    #[arg(long = "etcd", env = "KVPOOL_ETCD", value_delimiter = ',')]
    etcd: Vec<String>,
    /// Prefix of this cluster's keys in etcd [default: /kvpool/].
    #[arg(long, env = "KVPOOL_ETCD_PREFIX")]
    etcd_prefix: Option<String>,
    /// User of etcd's own authentication (with --etcd-password-file).
    #[arg(long, env = "KVPOOL_ETCD_USER")]
    etcd_user: Option<String>,
    /// File holding the etcd user's password.
    #[arg(long)]
    etcd_password_file: Option<PathBuf>,
    /// CA certificates (PEM) to verify etcd's certificate by (https:// URLs).
    #[arg(long)]
    etcd_ca_file: Option<PathBuf>,
    /// Client certificate (PEM) to present to etcd (with --etcd-key-file).
    #[arg(long)]
    etcd_cert_file: Option<PathBuf>,
    /// Private key (PEM) of --etcd-cert-file.
    #[arg(long)]
    etcd_key_file: Option<PathBuf>,
    /// The TCP address other nodes and clients reach this node at [default: the bound address].
    #[arg(long, env = "KVPOOL_ADVERTISE")]
    advertise: Option<String>,
    /// Heartbeat period in ms [default: 500].
    #[arg(long, env = "KVPOOL_HEARTBEAT_MS")]
    heartbeat_ms: Option<u64>,
    /// A peer silent this long (ms) is marked down [default: 2000].
    #[arg(long, env = "KVPOOL_DOWN_AFTER_MS")]
    down_after_ms: Option<u64>,
    /// On SIGTERM in a cluster, restart in place instead of draining: the others hold this
    /// node's keys for it, and a start on the same data directory within the restart window
    /// serves its objects again (true or false) [default: false].
    #[arg(long, env = "KVPOOL_RESTART_ON_SHUTDOWN")]
    restart_on_shutdown: Option<bool>,
    /// How long (ms) the nodes hold a restarting node's keys before marking it down; the same
    /// on every node [default: 60000].
    #[arg(long, env = "KVPOOL_RESTART_WINDOW_MS")]
    restart_window_ms: Option<u64>,
    /// Cap on this node's bulk transfers in bytes per second (large gets and puts, handoffs,
    /// the cluster's moves), e.g. 2GiB/s; 0 for none [default: 0].
    #[arg(long, env = "KVPOOL_BULK_RATE")]
    bulk_rate: Option<String>,
    /// Wrong tokens the node checks per second, every address together; past it, an address
    /// that failed recently is refused unchecked [default: 100].
    #[arg(long, env = "KVPOOL_AUTH_FAILURES_PER_SECOND")]
    auth_failures_per_second: Option<u32>,
    /// Wrong proofs of the cluster secret the node checks per second [default: 20].
    #[arg(long, env = "KVPOOL_CLUSTER_AUTH_FAILURES_PER_SECOND")]
    cluster_auth_failures_per_second: Option<u32>,
    /// Hand unpinned objects to their new owners when a node drains or joins (true or false)
    /// [default: true].
    #[arg(long, env = "KVPOOL_HANDOVER")]
    handover: Option<bool>,
    /// File holding the cluster secret shared by every node of the cluster
    /// [default: <data-dir>/cluster.secret, generated by a node that joins no one].
    #[arg(long, env = "KVPOOL_CLUSTER_SECRET_FILE")]
    cluster_secret_file: Option<PathBuf>,
    /// Directory of the disk tier under DRAM (evicted objects are written there); unset keeps
    /// the tier off [default: off].
    #[arg(long, env = "KVPOOL_DISK_PATH")]
    disk_path: Option<PathBuf>,
    /// Most bytes the disk tier may take, e.g. 64GiB (needed with --disk-path).
    #[arg(long, env = "KVPOOL_DISK_CAPACITY")]
    disk_capacity: Option<String>,
    /// Bytes of one disk region, the unit dropped when the tier is full [default: 64MiB].
    #[arg(long, env = "KVPOOL_DISK_REGION_SIZE")]
    disk_region_size: Option<String>,
    /// Most bytes of evicted objects waiting for the disk; past it they are not written
    /// [default: 256MiB].
    #[arg(long, env = "KVPOOL_DISK_QUEUE")]
    disk_queue: Option<String>,
    /// Which evicted objects go to disk: all or read-once [default: read-once].
    #[arg(long, env = "KVPOOL_DISK_ADMIT")]
    disk_admit: Option<String>,
    /// How the disk tier's files are read and written: direct (O_DIRECT; buffered where the
    /// file system refuses it) or buffered [default: direct].
    #[arg(long, env = "KVPOOL_DISK_IO")]
    disk_io: Option<String>,
    /// Print the effective configuration and exit.
    #[arg(long)]
    print_config: bool,
}

fn main() -> anyhow::Result<()> {
    kvpool_server::keep_heap_small();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("KVPOOL_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let mut config = match &cli.config {
        Some(p) => Config::from_file(p)?,
        None => Config::default(),
    };
    apply(&cli, &mut config)?;
    if cli.print_config {
        println!("{config:#?}");
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kvpoold")
        .build()?;
    rt.block_on(async move {
        let daemon = Daemon::start(config).await?;
        println!("{}", daemon.bound().ready_line());
        tracing::info!("{}", daemon.bound().ready_line());
        tokio::select! {
            _ = shutdown_signal() => daemon.leave().await,
            _ = daemon.left() => {}
        }
        tracing::info!("shutting down: draining in-flight requests");
        daemon.shutdown().await;
        Ok(())
    })
}

/// The flags over the file's values (and the environment's, which clap reads into the flags).
fn apply(cli: &Cli, c: &mut Config) -> anyhow::Result<()> {
    if let Some(v) = cli.node_id {
        c.node_id = v;
    }
    if let Some(v) = &cli.data_dir {
        c.data_dir = Some(v.clone());
    }
    if let Some(v) = &cli.memory {
        c.memory.size = parse_size(v).context("--memory")?;
    }
    if let Some(v) = cli.segments {
        c.memory.segments = v;
    }
    if let Some(v) = &cli.backing {
        c.memory.backing = v.clone();
    }
    if let Some(v) = &cli.huge_pages {
        c.memory.huge_pages = v.clone();
    }
    if let Some(v) = &cli.tcp {
        c.listen.tcp = v.clone();
    }
    if let Some(v) = &cli.quic {
        c.listen.quic = v.clone();
    }
    if let Some(v) = &cli.metrics {
        c.listen.metrics = v.clone();
    }
    if let Some(v) = &cli.unix {
        c.listen.unix = Some(v.clone());
    }
    if let Some(v) = &cli.resp {
        c.listen.resp = v.clone();
    }
    if let Some(v) = &cli.tls {
        c.listen.tls = v.clone();
    }
    if let Some(v) = &cli.fabric {
        c.listen.fabric = v.clone();
    }
    if let Some(v) = &cli.token {
        c.auth.token = v.clone();
    }
    apply_disk(cli, c)?;
    apply_cluster(cli, c)
}

/// The flags of `[disk]` over the file's values.
fn apply_disk(cli: &Cli, c: &mut Config) -> anyhow::Result<()> {
    if let Some(v) = &cli.disk_path {
        c.disk.path = Some(v.clone());
    }
    if let Some(v) = &cli.disk_capacity {
        c.disk.capacity = Some(parse_size(v).context("--disk-capacity")?);
    }
    if let Some(v) = &cli.disk_region_size {
        c.disk.region_size = parse_size(v).context("--disk-region-size")?;
    }
    if let Some(v) = &cli.disk_queue {
        c.disk.queue = parse_size(v).context("--disk-queue")?;
    }
    if let Some(v) = &cli.disk_admit {
        c.disk.admit = DiskAdmit::parse(v).context("--disk-admit")?;
    }
    if let Some(v) = &cli.disk_io {
        c.disk.io = v.parse().map_err(anyhow::Error::msg).context("--disk-io")?;
    }
    Ok(())
}

/// The flags of `[cluster]` and `[limits]` over the file's values.
fn apply_cluster(cli: &Cli, c: &mut Config) -> anyhow::Result<()> {
    if !cli.peers.is_empty() {
        c.cluster.peers = cli.peers.clone();
    }
    if !cli.etcd.is_empty() {
        c.cluster.etcd = cli.etcd.clone();
    }
    if let Some(v) = &cli.etcd_prefix {
        c.cluster.etcd_prefix = v.clone();
    }
    if let Some(v) = &cli.etcd_user {
        c.cluster.etcd_user = Some(v.clone());
    }
    if let Some(v) = &cli.etcd_password_file {
        c.cluster.etcd_password_file = Some(v.clone());
    }
    if let Some(v) = &cli.etcd_ca_file {
        c.cluster.etcd_ca_file = Some(v.clone());
    }
    if let Some(v) = &cli.etcd_cert_file {
        c.cluster.etcd_cert_file = Some(v.clone());
    }
    if let Some(v) = &cli.etcd_key_file {
        c.cluster.etcd_key_file = Some(v.clone());
    }
    if let Some(v) = &cli.advertise {
        c.cluster.advertise = Some(v.clone());
    }
    if let Some(v) = cli.heartbeat_ms {
        c.cluster.heartbeat_ms = v;
    }
    if let Some(v) = cli.down_after_ms {
        c.cluster.down_after_ms = v;
    }
    if let Some(v) = cli.restart_on_shutdown {
        c.cluster.restart_on_shutdown = v;
    }
    if let Some(v) = cli.restart_window_ms {
        c.cluster.restart_window_ms = v;
    }
    if let Some(v) = &cli.bulk_rate {
        c.limits.bulk_rate = parse_rate(v).context("--bulk-rate")?;
    }
    if let Some(v) = cli.auth_failures_per_second {
        c.limits.auth_failures_per_second = v;
    }
    if let Some(v) = cli.cluster_auth_failures_per_second {
        c.limits.cluster_auth_failures_per_second = v;
    }
    if let Some(v) = cli.handover {
        c.cluster.handover = v;
    }
    if let Some(v) = &cli.cluster_secret_file {
        c.cluster.secret_file = Some(v.clone());
    }
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("installing SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
