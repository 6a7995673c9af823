//! `kvpool`: the command-line client. Put, get, test, remove and inspect objects on a node.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use kvpool_client::blocking::Client;
use kvpool_client::{ClientConfig, Priority, SameHost};
use serde_json::json;

mod weights_cli;

#[derive(Parser, Debug)]
#[command(
    name = "kvpool",
    version,
    about = "Command-line client of a kvpool node"
)]
struct Cli {
    /// Node endpoint: tcp://host:port, quic://host:port or unix:///path/kvpool.sock.
    #[arg(
        short,
        long,
        env = "KVPOOL_ENDPOINT",
        default_value = "tcp://127.0.0.1:7370",
        global = true
    )]
    endpoint: String,
    /// Namespace.
    #[arg(
        short,
        long,
        env = "KVPOOL_NAMESPACE",
        default_value = "default",
        global = true
    )]
    namespace: String,
    /// Auth token.
    #[arg(
        long,
        env = "KVPOOL_TOKEN",
        default_value = "",
        hide_env_values = true,
        global = true
    )]
    token: String,
    /// CA certificate (PEM) for quic:// endpoints, e.g. the node's <data-dir>/tls-cert.pem.
    #[arg(long, env = "KVPOOL_CA", global = true)]
    ca: Option<PathBuf>,
    /// Accept any QUIC server certificate.
    #[arg(long, global = true)]
    insecure: bool,
    /// Keys are given in hex.
    #[arg(long, global = true)]
    hex: bool,
    /// Never use the same-host fast path.
    #[arg(long, global = true)]
    no_local: bool,
    /// Timeout per call, in milliseconds.
    #[arg(long, default_value_t = 10_000, global = true)]
    timeout_ms: u64,
    /// Priority of this command's bulk transfers on the nodes: background, low, normal or high.
    #[arg(long, default_value = "normal", value_parser = parse_priority, global = true)]
    priority: Priority,
    /// Deadline of every request in ms: a node refuses at once a bulk transfer it can't finish
    /// in time (exit code 2, "DeadlineUnmeetable"); 0 for none.
    #[arg(long, default_value_t = 0, global = true)]
    deadline_ms: u64,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Store a value read from FILE (or stdin when FILE is - or absent).
    Put {
        /// Key.
        key: String,
        /// File with the value; - for stdin.
        file: Option<PathBuf>,
        /// Pin the object (never evicted).
        #[arg(long)]
        pin: bool,
    },
    /// Print a value to stdout (or write it to --output). Exits 1 on a miss.
    Get {
        /// Key.
        key: String,
        /// Write the value here instead of stdout.
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// Print how many of the keys, in order, are present before the first missing one.
    /// Exits 1 when the first is missing.
    Exists {
        /// Keys, in prefix order.
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Remove keys (or, with --all, the whole namespace); prints how many were removed.
    Rm {
        /// Keys.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        keys: Vec<String>,
        /// Every object of the namespace, on every node, pinned ones too.
        #[arg(long)]
        all: bool,
    },
    /// List the keys that start with PREFIX, on every node of the cluster, one per line,
    /// sorted (bytes that are not printable UTF-8 are escaped as \xNN; with --hex, keys are
    /// printed in hex).
    Keys {
        /// Key prefix (empty or absent: every key).
        #[arg(default_value = "")]
        prefix: String,
    },
    /// Handoff (docs/HANDOFF.md): wait until every key is written, or failed by its producer
    /// (`kvpool fail`), for at most --wait-ms. Prints each key not written ("KEY missing",
    /// "KEY failed: REASON"); exits 0 when all are written, 1 when some are missing at the
    /// deadline, 3 when some were failed.
    Wait {
        /// Keys.
        #[arg(required = true)]
        keys: Vec<String>,
        /// How long to wait, in milliseconds.
        #[arg(long, default_value_t = 30_000)]
        wait_ms: u64,
    },
    /// Handoff: a producer gives up on keys; every waiter hears REASON at once.
    Fail {
        /// Keys.
        #[arg(required = true)]
        keys: Vec<String>,
        /// Why (told to the waiters).
        #[arg(long, default_value = "failed by its producer")]
        reason: String,
    },
    /// Handoff: abort a request on both sides: its objects removed, its pending allocations
    /// (reservations, puts in flight) released, its waiters told REASON at once. Prints how many
    /// objects and allocations were freed.
    Cancel {
        /// Keys.
        #[arg(required = true)]
        keys: Vec<String>,
        /// Why (told to the waiters).
        #[arg(long, default_value = "cancelled")]
        reason: String,
    },
    /// Handoff lease on keys, written yet or not: remove them --ttl-ms from now unless renewed
    /// (run again), or end their lease (--ttl-ms 0). Prints how many keys are present.
    Expire {
        /// Keys.
        #[arg(required = true)]
        keys: Vec<String>,
        /// Lease length in milliseconds (0: end the lease).
        #[arg(long)]
        ttl_ms: u64,
    },
    /// Context caching: block keys of token prefixes (docs/HASHING.md).
    #[command(subcommand)]
    Prefix(PrefixCmd),
    /// Print the node's statistics.
    Stats {
        /// As JSON.
        #[arg(long)]
        json: bool,
    },
    /// The cluster: its view, and draining nodes out of it.
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// Model weights: publish safetensors checkpoints into the pool and load them back
    /// (docs/WEIGHTS.md).
    Weights(weights_cli::WeightsArgs),
}

#[derive(Subcommand, Debug)]
enum ClusterCmd {
    /// Print the cluster view: every node with its address, capacity and use, state and
    /// epoch, and the view's version.
    Status {
        /// As JSON.
        #[arg(long)]
        json: bool,
    },
    /// Drain a node: it takes no new objects, moves its pinned objects to their new owners,
    /// hands its unpinned ones (KV blocks) to theirs, hottest first, until `drain_timeout_ms`
    /// (`[cluster] handover`), then leaves the cluster and exits. Needs the cluster secret
    /// (and the node token when nodes have one).
    Drain {
        /// Node id.
        node: u32,
        /// Wait until the node has left (state down).
        #[arg(long)]
        wait: bool,
        /// File holding the cluster secret [default: cluster.secret in the data directory of
        /// the endpoint's node, when it runs on this host].
        #[arg(long, env = "KVPOOL_CLUSTER_SECRET_FILE")]
        cluster_secret_file: Option<PathBuf>,
    },
}

#[derive(Subcommand, Debug)]
enum PrefixCmd {
    /// Print the key of every full block of the tokens (hex, one per line); needs no node.
    Hash {
        #[command(flatten)]
        seed: SeedArgs,
        /// Token ids; read from stdin (whitespace separated) when absent.
        tokens: Vec<u32>,
    },
    /// Print how many leading blocks of the tokens the node holds.
    Match {
        #[command(flatten)]
        seed: SeedArgs,
        /// Token ids; read from stdin when absent.
        tokens: Vec<u32>,
    },
    /// Per namespace: objects, prefix lookups (blocks asked, matched) and get hit rate.
    Stats,
}

/// What makes KV bytes differ for the same tokens (see docs/HASHING.md).
#[derive(clap::Args, Debug)]
struct SeedArgs {
    /// Model id.
    #[arg(long)]
    model: String,
    /// Tenant.
    #[arg(long, default_value = "")]
    tenant: String,
    /// KV dtype.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Tensor-parallel rank.
    #[arg(long, default_value_t = 0)]
    tp_rank: u32,
    /// Tensor-parallel size.
    #[arg(long, default_value_t = 1)]
    tp_size: u32,
    /// Pipeline stage.
    #[arg(long, default_value_t = 0)]
    pp_stage: u32,
    /// Layers held, START:END (end exclusive).
    #[arg(long, default_value = "0:0")]
    layers: String,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_tokens: u32,
    /// Per-request salt (vLLM's cache_salt).
    #[arg(long)]
    salt: Option<String>,
}

impl SeedArgs {
    fn seed(&self) -> anyhow::Result<kvpool_client::PrefixSeed> {
        let (a, b) = self
            .layers
            .split_once(':')
            .context("--layers takes START:END")?;
        Ok(kvpool_client::PrefixSeed {
            tenant: self.tenant.clone(),
            model: self.model.clone(),
            dtype: self.dtype.clone(),
            tp_rank: self.tp_rank,
            tp_size: self.tp_size,
            pp_stage: self.pp_stage,
            layer_start: a.parse().context("--layers start")?,
            layer_end: b.parse().context("--layers end")?,
            block_tokens: self.block_tokens,
            salt: self.salt.clone(),
        })
    }
}

fn tokens_or_stdin(tokens: &[u32]) -> anyhow::Result<Vec<u32>> {
    if !tokens.is_empty() {
        return Ok(tokens.to_vec());
    }
    let text = String::from_utf8(read_stdin()?).context("tokens on stdin must be text")?;
    text.split_whitespace()
        .map(|t| t.parse().with_context(|| format!("bad token {t:?}")))
        .collect()
}

fn main() {
    match run() {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("kvpool: {e:#}");
            std::process::exit(2);
        }
    }
}

fn run() -> anyhow::Result<i32> {
    let cli = Cli::parse();
    if let Cmd::Prefix(PrefixCmd::Hash { seed, tokens }) = &cli.cmd {
        return prefix_hash(seed, tokens);
    }
    let cfg = cli.config();
    let client = Client::connect(&cli.endpoint, cfg.clone())
        .with_context(|| format!("connecting to {}", cli.endpoint))?;
    match &cli.cmd {
        Cmd::Put { key, file, pin } => {
            let value = read_value(file.as_deref())?;
            put(&client, &cli.key(key)?, &value, *pin)
        }
        Cmd::Get { key, output } => get(&client, &cli.key(key)?, output.as_deref()),
        Cmd::Exists { keys } => {
            let keys = keys
                .iter()
                .map(|k| cli.key(k))
                .collect::<anyhow::Result<Vec<_>>>()?;
            exists(&client, &keys)
        }
        Cmd::Rm { keys, all } => rm(&cli, &client, keys, *all),
        Cmd::Keys { prefix } => keys(&cli, &client, &cli.key(prefix)?),
        Cmd::Wait { keys, wait_ms } => {
            let keys = keys
                .iter()
                .map(|k| cli.key(k))
                .collect::<anyhow::Result<Vec<_>>>()?;
            wait(&client, &keys, *wait_ms)
        }
        Cmd::Expire { keys, ttl_ms } => {
            let keys = keys
                .iter()
                .map(|k| cli.key(k))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
            let ttl = std::time::Duration::from_millis(*ttl_ms);
            let n = client.block_on(client.async_client().expire(&refs, ttl))?;
            println!("{n}");
            Ok(0)
        }
        Cmd::Fail { keys, reason } => {
            let keys = keys
                .iter()
                .map(|k| cli.key(k))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
            let n = client.block_on(client.async_client().fail(&refs, reason))?;
            println!("{n}");
            Ok(0)
        }
        Cmd::Cancel { keys, reason } => {
            let keys = keys
                .iter()
                .map(|k| cli.key(k))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
            let n = client.block_on(client.async_client().cancel(&refs, reason))?;
            println!("{n}");
            Ok(0)
        }
        Cmd::Prefix(PrefixCmd::Hash { .. }) => unreachable!("handled before connecting"),
        Cmd::Prefix(PrefixCmd::Match { seed, tokens }) => prefix_match(&client, seed, tokens),
        Cmd::Prefix(PrefixCmd::Stats) => prefix_stats(&client),
        Cmd::Cluster(ClusterCmd::Status { json }) => cluster_status(&client, *json),
        Cmd::Cluster(ClusterCmd::Drain {
            node,
            wait,
            cluster_secret_file,
        }) => {
            let path = match cluster_secret_file {
                Some(p) => p.clone(),
                None => local_secret_file(client.async_client().hello())?,
            };
            drain(&cli.endpoint, cfg, &client, &path, *node, *wait)
        }
        Cmd::Weights(args) => weights_cli::run(&client, args),
        Cmd::Stats { json } => {
            let s = client.stats()?;
            if *json {
                println!("{}", stats_json(&s));
            } else {
                print_stats(&s, client.is_local());
            }
            Ok(0)
        }
    }
}

impl Cli {
    /// The client configuration the global options ask for.
    fn config(&self) -> ClientConfig {
        ClientConfig {
            namespace: self.namespace.clone(),
            token: self.token.clone(),
            client_name: "kvpool-cli".into(),
            timeout: Duration::from_millis(self.timeout_ms),
            ca: self.ca.clone(),
            insecure_skip_verify: self.insecure,
            same_host: if self.no_local {
                SameHost::Off
            } else {
                SameHost::Auto
            },
            priority: self.priority,
            deadline: (self.deadline_ms > 0).then(|| Duration::from_millis(self.deadline_ms)),
            ..ClientConfig::default()
        }
    }

    /// A key as given on the command line: its bytes, or decoded from hex with `--hex`.
    fn key(&self, k: &str) -> anyhow::Result<Vec<u8>> {
        if self.hex {
            decode_hex(k)
        } else {
            Ok(k.as_bytes().to_vec())
        }
    }
}

/// `kvpool prefix hash`: needs no node.
fn prefix_hash(seed: &SeedArgs, tokens: &[u32]) -> anyhow::Result<i32> {
    let seed = seed.seed()?;
    for k in seed.block_keys(&tokens_or_stdin(tokens)?) {
        println!(
            "{}",
            k.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
    }
    Ok(0)
}

/// The value of `kvpool put`: FILE, or stdin when FILE is - or absent.
fn read_value(file: Option<&std::path::Path>) -> anyhow::Result<Vec<u8>> {
    match file {
        None => read_stdin(),
        Some(p) if p.as_os_str() == "-" => read_stdin(),
        Some(p) => std::fs::read(p).with_context(|| format!("reading {}", p.display())),
    }
}

fn put(client: &Client, key: &[u8], value: &[u8], pin: bool) -> anyhow::Result<i32> {
    if pin {
        client.put_pinned(key, value)?
    } else {
        client.put(key, value)?
    }
    eprintln!("stored {} bytes", value.len());
    Ok(0)
}

/// `kvpool get`: exits 1 on a miss.
fn get(client: &Client, key: &[u8], output: Option<&std::path::Path>) -> anyhow::Result<i32> {
    let Some(v) = client.get(key)? else {
        eprintln!("miss");
        return Ok(1);
    };
    match output {
        Some(p) => std::fs::write(p, &v).with_context(|| format!("writing {}", p.display()))?,
        None => std::io::stdout().lock().write_all(&v)?,
    }
    Ok(0)
}

/// `kvpool exists`: exits 1 when the first key is missing.
fn exists(client: &Client, keys: &[Vec<u8>]) -> anyhow::Result<i32> {
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    let n = client.batch_exists(&refs)?;
    println!("{n}");
    Ok(if n == 0 { 1 } else { 0 })
}

/// `kvpool rm`: one key at a time, in order.
/// `kvpool rm`: prints how many objects were removed.
fn rm(cli: &Cli, client: &Client, keys: &[String], all: bool) -> anyhow::Result<i32> {
    if all {
        println!("{}", client.remove_all()?);
        return Ok(0);
    }
    let mut n = 0;
    for k in keys {
        n += client.remove(&cli.key(k)?)? as u64;
    }
    println!("{n}");
    Ok(0)
}

/// `kvpool keys`: one key per line, sorted.
fn wait(client: &Client, keys: &[Vec<u8>], wait_ms: u64) -> anyhow::Result<i32> {
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let timeout = std::time::Duration::from_millis(wait_ms);
    let got = client.block_on(client.async_client().wait(&refs, timeout))?;
    let mut out = std::io::stdout().lock();
    for k in &got.missing {
        writeln!(out, "{} missing", printable(k))?;
    }
    for (k, reason) in &got.failed {
        writeln!(out, "{} failed: {reason}", printable(k))?;
    }
    Ok(if !got.failed.is_empty() {
        3
    } else if !got.missing.is_empty() {
        1
    } else {
        0
    })
}

fn keys(cli: &Cli, client: &Client, prefix: &[u8]) -> anyhow::Result<i32> {
    let mut out = std::io::stdout().lock();
    for k in client.keys_with_prefix(prefix)? {
        let line = if cli.hex {
            k.iter().map(|b| format!("{b:02x}")).collect()
        } else {
            printable(&k)
        };
        writeln!(out, "{line}")?;
    }
    Ok(0)
}

/// A key as one line of text: UTF-8 as it is, but a backslash, control characters (a newline
/// would split the line) and bytes that are not UTF-8 escaped.
fn printable(key: &[u8]) -> String {
    let mut s = String::with_capacity(key.len());
    for chunk in key.utf8_chunks() {
        for c in chunk.valid().chars() {
            if c == '\\' || c.is_control() {
                s.extend(c.escape_default());
            } else {
                s.push(c);
            }
        }
        for b in chunk.invalid() {
            s.push_str(&format!("\\x{b:02x}"));
        }
    }
    s
}

/// `kvpool prefix match`: exits 1 when the first block is missing.
fn prefix_match(client: &Client, seed: &SeedArgs, tokens: &[u32]) -> anyhow::Result<i32> {
    let seed = seed.seed()?;
    let tokens = tokens_or_stdin(tokens)?;
    let n = client.match_prefix(kvpool_client::Prefix::Tokens {
        seed: &seed,
        tokens: &tokens,
    })?;
    println!("{n}");
    Ok(if n == 0 { 1 } else { 0 })
}

fn prefix_stats(client: &Client) -> anyhow::Result<i32> {
    let s = client.stats()?;
    println!(
        "{:<24} {:>10} {:>14} {:>14} {:>9} {:>9}",
        "namespace", "blocks", "prefix-asked", "prefix-hit", "prefix%", "get-hit%"
    );
    let pct = |a: u64, b: u64| {
        if b == 0 {
            0.0
        } else {
            a as f64 * 100.0 / b as f64
        }
    };
    for n in &s.namespaces {
        println!(
            "{:<24} {:>10} {:>14} {:>14} {:>8.1}% {:>8.1}%",
            n.name,
            n.objects,
            n.prefix_blocks,
            n.prefix_hits,
            pct(n.prefix_hits, n.prefix_blocks),
            pct(n.hits, n.hits + n.misses)
        );
    }
    Ok(0)
}

/// `kvpool cluster status`: the view, with each live node's use.
fn cluster_status(client: &Client, json: bool) -> anyhow::Result<i32> {
    let view = client.async_client().routing_view();
    let view = client.view().unwrap_or(view);
    let rows: Vec<ClusterRow> = view
        .nodes
        .iter()
        .map(|n| {
            let stats = (n.state != kvpool::placement::NodeState::Down)
                .then(|| client.node_stats(n.id).ok())
                .flatten();
            (n.clone(), stats)
        })
        .collect();
    if json {
        println!("{}", cluster_json(view.version, &rows));
    } else {
        print_cluster(view.version, &rows);
    }
    Ok(0)
}

/// `kvpool cluster drain`: asks node `node` to drain, over a connection that proves the
/// cluster secret in `secret_file`; with `wait`, until the node has left.
fn drain(
    endpoint: &str,
    cfg: ClientConfig,
    client: &Client,
    secret_file: &std::path::Path,
    node: u32,
    wait: bool,
) -> anyhow::Result<i32> {
    let secret = std::fs::read(secret_file)
        .map_err(anyhow::Error::from)
        .and_then(|b| {
            kvpool::protocol::auth::ClusterSecret::from_file_contents(&b)
                .map_err(anyhow::Error::from)
        })
        .with_context(|| format!("reading the cluster secret {}", secret_file.display()))?;
    let control = Client::connect(
        endpoint,
        ClientConfig {
            cluster_secret: Some(secret),
            ..cfg
        },
    )
    .with_context(|| format!("connecting to {endpoint} as a cluster peer"))?;
    control.drain_node(node)?;
    eprintln!("node {node} is draining");
    if !wait {
        return Ok(0);
    }
    let start = std::time::Instant::now();
    loop {
        let v = client.view()?;
        let gone = v
            .node(kvpool::NodeId(node))
            .is_none_or(|n| n.state == kvpool::placement::NodeState::Down);
        if gone {
            eprintln!("node {node} has left");
            return Ok(0);
        }
        if start.elapsed() > Duration::from_secs(600) {
            bail!("node {node} is still draining after 10 minutes");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The cluster secret file of the endpoint's node, when it runs on this host: next to its Unix
/// socket, in its data directory.
fn local_secret_file(hello: &kvpool::protocol::HelloInfo) -> anyhow::Result<PathBuf> {
    let dir = std::path::Path::new(&hello.uds_path).parent();
    match dir {
        Some(d) if hello.host_id == kvpool::segment::host_id() && !hello.uds_path.is_empty() => {
            Ok(d.join("cluster.secret"))
        }
        _ => bail!(
            "node {} runs on another host: pass --cluster-secret-file with a copy of the \
             cluster secret",
            hello.node
        ),
    }
}

fn read_stdin() -> anyhow::Result<Vec<u8>> {
    let mut v = Vec::new();
    std::io::stdin().lock().read_to_end(&mut v)?;
    Ok(v)
}

fn decode_hex(s: &str) -> anyhow::Result<Vec<u8>> {
    if s.len() % 2 != 0 {
        bail!("hex key {s:?} has an odd length");
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).with_context(|| format!("bad hex key {s:?}")))
        .collect()
}

fn print_stats(s: &kvpool::pool::PoolStats, local: bool) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!(
        "node {}{}",
        s.node,
        if local { " (same host: mapped)" } else { "" }
    );
    println!(
        "objects {}  pending {}  hits {}  misses {}  evictions {}",
        s.objects, s.pending, s.hits, s.misses, s.evictions
    );
    for seg in &s.segments {
        println!(
            "segment {}: {:.3} / {:.3} GiB used, {} blocks, fragmentation {:.1}%",
            seg.id,
            gib(seg.used_bytes),
            gib(seg.capacity),
            seg.live_blocks,
            seg.external_fragmentation * 100.0
        );
    }
    for n in &s.namespaces {
        let quota = if n.quota_bytes == u64::MAX {
            "none".to_string()
        } else {
            format!("{:.3} GiB", gib(n.quota_bytes))
        };
        println!(
            "namespace {:?}: {} objects, {:.3} GiB used, {:.3} GiB pinned, quota {}",
            n.name,
            n.objects,
            gib(n.used_bytes),
            gib(n.pinned_bytes),
            quota
        );
    }
}

/// `kvpool stats --json`: the node's statistics as one JSON object.
fn stats_json(s: &kvpool::pool::PoolStats) -> serde_json::Value {
    let segments: Vec<_> = s
        .segments
        .iter()
        .map(|g| {
            json!({
                "id": g.id,
                "capacity": g.capacity,
                "used_bytes": g.used_bytes,
                "free_bytes": g.free_bytes,
                "live_blocks": g.live_blocks,
                "largest_free_run": g.largest_free_run,
                "external_fragmentation": g.external_fragmentation,
            })
        })
        .collect();
    let namespaces: Vec<_> = s
        .namespaces
        .iter()
        .map(|n| {
            json!({
                "name": n.name,
                "id": n.id,
                "quota_bytes": n.quota_bytes,
                "used_bytes": n.used_bytes,
                "pinned_bytes": n.pinned_bytes,
                "objects": n.objects,
            })
        })
        .collect();
    json!({
        "node": s.node,
        "objects": s.objects,
        "pending": s.pending,
        "hits": s.hits,
        "misses": s.misses,
        "evictions": s.evictions,
        "commits": s.commits,
        "reaped": s.reaped,
        "segments": segments,
        "namespaces": namespaces,
    })
}

type ClusterRow = (kvpool::placement::NodeInfo, Option<kvpool::pool::PoolStats>);

fn used_bytes(s: &kvpool::pool::PoolStats) -> u64 {
    s.segments.iter().map(|g| g.used_bytes).sum()
}

fn print_cluster(version: u64, rows: &[ClusterRow]) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!("cluster view version {version}, {} nodes", rows.len());
    println!(
        "{:>5}  {:<9} {:>5}  {:<22} {:>11} {:>11} {:>10}",
        "node", "state", "epoch", "tcp", "capacity", "used", "objects"
    );
    for (n, s) in rows {
        let (used, objects) = match s {
            Some(s) => (
                format!("{:.3} GiB", gib(used_bytes(s))),
                s.objects.to_string(),
            ),
            None => ("-".into(), "-".into()),
        };
        println!(
            "{:>5}  {:<9} {:>5}  {:<22} {:>7.3} GiB {:>11} {:>10}",
            n.id,
            n.state.name(),
            n.epoch,
            n.tcp,
            gib(n.capacity),
            used,
            objects
        );
    }
}

/// `kvpool cluster status --json`: the view as one JSON object; a node whose statistics could
/// not be read has `null` use.
fn cluster_json(version: u64, rows: &[ClusterRow]) -> serde_json::Value {
    let nodes: Vec<_> = rows
        .iter()
        .map(|(n, s)| {
            json!({
                "id": n.id,
                "state": n.state.name(),
                "epoch": n.epoch,
                "tcp": n.tcp,
                "quic": n.quic,
                "metrics": n.metrics,
                "capacity": n.capacity,
                "used_bytes": s.as_ref().map(used_bytes),
                "objects": s.as_ref().map(|s| s.objects),
            })
        })
        .collect();
    json!({ "version": version, "nodes": nodes })
}

fn parse_priority(s: &str) -> Result<Priority, String> {
    Priority::parse(s).ok_or_else(|| format!("{s:?}: one of background, low, normal, high"))
}
