//! `kvpool prefix`: the block keys of token prefixes (docs/HASHING.md), how many of them a node
//! holds, and the prefix lookups per namespace.

use anyhow::Context;
use clap::Subcommand;
use kvpool_client::blocking::Client;

use crate::text::read_stdin;

#[derive(Subcommand, Debug)]
pub(crate) enum PrefixCmd {
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
pub(crate) struct SeedArgs {
    /// Model id.
    #[arg(long)]
    model: String,
    /// Tenant.
    #[arg(long, default_value = "")]
    tenant: String,
    /// KV dtype (`bf16`, `fp8_e4m3`, …); empty unless given, as in every other client.
    #[arg(long, default_value = "")]
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

/// Runs a `kvpool prefix` command that needs a node (`hash` needs none: [`hash`]).
pub(crate) fn run(client: &Client, cmd: &PrefixCmd) -> anyhow::Result<i32> {
    match cmd {
        PrefixCmd::Hash { seed, tokens } => hash(seed, tokens),
        PrefixCmd::Match { seed, tokens } => prefix_match(client, seed, tokens),
        PrefixCmd::Stats => stats(client),
    }
}

/// `kvpool prefix hash`: needs no node.
pub(crate) fn hash(seed: &SeedArgs, tokens: &[u32]) -> anyhow::Result<i32> {
    let seed = seed.seed()?;
    for k in seed.block_keys(&tokens_or_stdin(tokens)?) {
        println!(
            "{}",
            k.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
    }
    Ok(0)
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

fn stats(client: &Client) -> anyhow::Result<i32> {
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
