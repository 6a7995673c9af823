//! `kvpool`: the command-line client. Put, get, test, remove and inspect objects on a node.
//!
//! This file holds the global options, the table of subcommands and their dispatch; each family
//! of subcommands lives in a module of its own: `objects` (put, get, exists, rm, keys),
//! `handoff` (wait, fail, cancel, expire), `events`, `prefix`, `stats`, `cluster`, `top` and
//! `weights_cli`, with
//! `text` for keys and values as the command line gives and prints them.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kvpool_client::blocking::Client;
use kvpool_client::{ClientConfig, Priority, SameHost};

mod cluster;
mod events;
mod handoff;
mod objects;
mod prefix;
mod stats;
mod text;
mod top;
mod weights_cli;

use cluster::ClusterCmd;
use prefix::PrefixCmd;

#[derive(Parser, Debug)]
#[command(
    name = "kvpool",
    version,
    about = "Command-line client of a kvpool node"
)]
struct Cli {
    /// Node endpoint: tcp://host:port, tls://host:port, quic://host:port, fabric://host:port or
    /// unix:///path/kvpool.sock.
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
    /// KV events for cache-aware routers: every key of the namespace under PREFIX stored in or
    /// removed from a tier (dram, disk) of each node serving now, one line each ("stored dram
    /// KEY", "removed disk KEY", "cleared dram"; with --json, JSON lines with node and
    /// sequence number), until interrupted or --count events. A "lagged" line says the node
    /// dropped events for this reader: list the keys again.
    Events {
        /// Key prefix (empty: every key).
        #[arg(long, default_value = "")]
        prefix: String,
        /// JSON lines.
        #[arg(long)]
        json: bool,
        /// Stop after this many events.
        #[arg(long)]
        count: Option<u64>,
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
    /// A live view of the cluster: per node its state, memory used and capacity, objects, hit
    /// rate, operations and payload bytes per second in and out, refusals by limits and
    /// evictions per second, disk tier use; and the totals. A node that does not answer is
    /// shown down.
    Top(top::TopArgs),
    /// Model weights: publish safetensors checkpoints into the pool and load them back
    /// (docs/WEIGHTS.md).
    Weights(weights_cli::WeightsArgs),
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

/// Runs the command line's subcommand; its exit code.
fn run() -> anyhow::Result<i32> {
    let cli = Cli::parse();
    if let Cmd::Prefix(PrefixCmd::Hash { seed, tokens }) = &cli.cmd {
        return prefix::hash(seed, tokens);
    }
    let cfg = cli.config();
    let client = Client::connect(&cli.endpoint, cfg.clone())
        .with_context(|| format!("connecting to {}", cli.endpoint))?;
    match &cli.cmd {
        Cmd::Put { key, file, pin } => {
            let value = objects::read_value(file.as_deref())?;
            objects::put(&client, &cli.key(key)?, &value, *pin)
        }
        Cmd::Get { key, output } => objects::get(&client, &cli.key(key)?, output.as_deref()),
        Cmd::Exists { keys } => objects::exists(&client, &cli.keys(keys)?),
        Cmd::Rm { keys, all } => objects::rm(&cli, &client, keys, *all),
        Cmd::Keys { prefix } => objects::keys(&cli, &client, &cli.key(prefix)?),
        Cmd::Wait { keys, wait_ms } => handoff::wait(&client, &cli.keys(keys)?, *wait_ms),
        Cmd::Expire { keys, ttl_ms } => handoff::expire(&client, &cli.keys(keys)?, *ttl_ms),
        Cmd::Fail { keys, reason } => handoff::fail(&client, &cli.keys(keys)?, reason),
        Cmd::Cancel { keys, reason } => handoff::cancel(&client, &cli.keys(keys)?, reason),
        Cmd::Events {
            prefix,
            json,
            count,
        } => {
            let fmt = events::Format {
                json: *json,
                hex: cli.hex,
            };
            events::run(&client, &cli.key(prefix)?, *count, fmt)
        }
        Cmd::Prefix(cmd) => prefix::run(&client, cmd),
        Cmd::Cluster(cmd) => cluster::run(&cli.endpoint, cfg, &client, cmd),
        Cmd::Weights(args) => weights_cli::run(&client, args),
        Cmd::Stats { json } => stats::show(&client, *json),
        Cmd::Top(args) => top::run(&client, args),
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
            text::decode_hex(k)
        } else {
            Ok(k.as_bytes().to_vec())
        }
    }

    /// Keys as given on the command line (see [`Cli::key`]).
    fn keys(&self, keys: &[String]) -> anyhow::Result<Vec<Vec<u8>>> {
        keys.iter().map(|k| self.key(k)).collect()
    }
}

fn parse_priority(s: &str) -> Result<Priority, String> {
    Priority::parse(s).ok_or_else(|| format!("{s:?}: one of background, low, normal, high"))
}
