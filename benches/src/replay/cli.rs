//! The `replay` subcommand: flags, progress, the summary table and the output files.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kvpool::eviction::DensityConfig;

use super::cache::Order;
use super::sweep::{
    erased::Name, grid, with_disk, write_csv, write_json, Engine, Policy, Row, RunSpec, Scenario,
    Setup, SimOptions,
};
use super::synth::{self, Workload};
use super::tiers::Admit;
use super::trace::{Trace, TraceFormat};
use super::ttft::TtftModel;
use crate::units::parse_size;

/// The trace shipped with kvpool (Mooncake's conversation trace, Apache-2.0; see
/// benches/traces/README.md).
pub const BUNDLED_TRACE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/traces/conversation_trace.jsonl"
);

/// The policies replayed when `--policy` is not given: LRU, the pool's default policy
/// (`replay_defaults_show_the_default_policy` keeps this in step with `PolicyKind::default()`),
/// Belady's optimum and the unbounded ceiling.
pub const DEFAULT_POLICIES: &str = "lru,s3fifo-lru,belady,unbounded";

/// Parses `--density`.
pub fn parse_density(s: &str) -> anyhow::Result<DensityConfig> {
    let mut c = DensityConfig::default();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        match item.split_once('=') {
            Some(("sample", v)) => c.sample = v.parse().context("sample")?,
            Some(("ghost", v)) => c.ghost_factor = v.parse().context("ghost")?,
            None if item == "no-refs" => c.refs = false,
            None if item == "no-gap" => c.gap = false,
            None if item == "no-depth" => c.depth = false,
            None if item == "no-ghost" => c.ghost = false,
            None if item == "no-age" => c.age = false,
            _ => bail!("unknown --density item {item:?}"),
        }
    }
    if c.sample == 0 || c.ghost_factor > 16 {
        bail!("--density: sample must be at least 1 and ghost at most 16");
    }
    Ok(c)
}

/// KV bytes per token of common models (bf16), for `--model`.
pub const MODELS: &[(&str, u64)] = &[
    // 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes
    ("llama3-8b", 128 << 10),
    // 80 layers x 8 x 128 x 2 x 2
    ("llama3-70b", 320 << 10),
    // 28 layers x 4 x 128 x 2 x 2
    ("qwen2.5-7b", 56 << 10),
    // MLA: 61 layers x (512 + 64) x 2 bytes = 68.6 KiB
    ("deepseek-v3", 61 * 576 * 2),
];

/// `kvpool-bench replay`: cache hit rates on a request trace.
#[derive(Args, Debug, Clone)]
pub struct ReplayArgs {
    /// Trace file (JSONL). Default: the bundled Mooncake conversation trace.
    #[arg(long, conflicts_with = "synthetic")]
    pub trace: Option<PathBuf>,
    /// Replay a synthetic workload instead of a trace file (see `kvpool-bench gen-trace`).
    #[arg(long, value_enum)]
    pub synthetic: Option<Workload>,
    /// Seed of the synthetic workload.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Requests of the synthetic workload.
    #[arg(long, default_value_t = 20_000)]
    pub requests: usize,
    /// Trace format.
    #[arg(long, value_enum, default_value = "auto")]
    pub format: TraceFormat,
    /// Tokens per block (default: what the format implies: 512 Mooncake, 16 Qwen).
    #[arg(long)]
    pub block_tokens: Option<u64>,
    /// Milliseconds per timestamp unit (default: 1 Mooncake, 1000 Qwen).
    #[arg(long)]
    pub time_unit_ms: Option<f64>,
    /// Replay only the first N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Engines: sim (policy simulation) and/or pool (a real kvpool).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "sim")]
    pub engine: Vec<Engine>,
    /// Policies. Default: LRU, the pool's default policy, Belady and the unbounded ceiling.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = DEFAULT_POLICIES
    )]
    pub policy: Vec<Policy>,
    /// `hit-density` parameters for the simulation, for ablations: comma-separated
    /// `sample=N`, `ghost=N` (ghost factor), `no-refs`, `no-gap`, `no-depth`, `no-ghost`,
    /// `no-age`. Default: the pool's.
    #[arg(long, default_value = "")]
    pub density: String,
    /// Capacity per node, in blocks.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1000,2000,5000,10000,20000,50000",
        conflicts_with = "capacity_bytes"
    )]
    pub capacity: Vec<u64>,
    /// Capacity per node in bytes instead (e.g. 64GiB,256GiB); converted with the block size.
    #[arg(long, value_delimiter = ',')]
    pub capacity_bytes: Vec<String>,
    /// A simulated disk tier under each node's DRAM, in multiples of its DRAM capacity (e.g. 10):
    /// every simulated run of a policy other than belady and unbounded, on one node or private
    /// caches, is followed by the same run over a disk of that many times its blocks. Default:
    /// none.
    #[arg(long, value_delimiter = ',')]
    pub disk_ratio: Vec<f64>,
    /// Which blocks evicted from DRAM the disk tier takes: all, or read-once (those read at least
    /// once since they came into DRAM).
    #[arg(long, value_enum, default_value = "all")]
    pub disk_admit: Admit,
    /// The order in which the simulation touches and inserts a request's blocks: present-first
    /// (every present block touched, then the missing ones inserted) or request-order (block by
    /// block, first to last).
    #[arg(long, value_enum, default_value = "present-first")]
    pub order: Order,
    /// Node counts.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub nodes: Vec<u32>,
    /// Scenarios for more than one node.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "pooled,private"
    )]
    pub scenario: Vec<Scenario>,
    /// Model preset for the block size (KV bytes per token x tokens per block).
    #[arg(long, default_value = "llama3-8b")]
    pub model: String,
    /// Bytes per block, overriding --model (e.g. 64KiB for a quick pool-engine run).
    #[arg(long)]
    pub block_bytes: Option<String>,
    /// Running daemons for the pool engine (repeat for several nodes); default in-process.
    #[arg(long)]
    pub endpoint: Vec<String>,
    /// Namespace on those daemons.
    #[arg(long, default_value = "default")]
    pub namespace: String,
    /// Index shards of in-process pool nodes (1, like the daemon's default).
    #[arg(long, default_value_t = 1)]
    pub pool_shards: usize,
    /// Engine prefill throughput for the TTFT model, tokens/s.
    #[arg(long, default_value_t = 10_000.0)]
    pub prefill_tps: f64,
    /// Pool-to-engine bandwidth for the TTFT model, GB/s.
    #[arg(long, default_value_t = 10.0)]
    pub pool_gbps: f64,
    /// Directory for replay.csv, replay.json and the PNG charts.
    #[arg(long, default_value = "bench-out/replay")]
    pub out: PathBuf,
    /// Don't draw charts.
    #[arg(long)]
    pub no_plot: bool,
}

/// `kvpool-bench gen-trace`: writes a synthetic workload as JSONL.
#[derive(Args, Debug, Clone)]
pub struct GenTraceArgs {
    /// The workload.
    #[arg(long, value_enum)]
    pub workload: Workload,
    /// Seed: the same seed always gives the same trace.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Requests.
    #[arg(long, default_value_t = 20_000)]
    pub requests: usize,
    /// Output file (Mooncake JSONL, like the bundled trace).
    #[arg(long)]
    pub out: PathBuf,
}

/// Runs `gen-trace`.
pub fn gen_trace(args: &GenTraceArgs) -> anyhow::Result<()> {
    let t = synth::generate(args.workload, args.seed, args.requests);
    let f = std::fs::File::create(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let mut w = std::io::BufWriter::new(f);
    synth::write_jsonl(&t, &mut w)?;
    std::io::Write::flush(&mut w)?;
    eprintln!(
        "wrote {}: {} requests, {} blocks ({} distinct)",
        args.out.display(),
        t.requests.len(),
        t.total_blocks(),
        t.distinct_blocks()
    );
    Ok(())
}

/// Runs the subcommand; returns the rows.
pub fn run(args: &ReplayArgs) -> anyhow::Result<Vec<Row>> {
    let (trace, trace_name) = load_trace(args)?;
    let block_bytes = block_bytes(args, &trace)?;
    let capacities = capacities(args, block_bytes)?;
    if args.nodes.contains(&0) {
        bail!("--nodes must be at least 1");
    }
    if args.disk_ratio.iter().any(|r| !r.is_finite() || *r < 0.0) {
        bail!("--disk-ratio must be finite and not negative");
    }
    let setup = Setup {
        trace: &trace,
        trace_name,
        block_bytes,
        ttft: TtftModel {
            prefill_tokens_per_s: args.prefill_tps,
            pool_bytes_per_s: args.pool_gbps * 1e9,
            block_bytes,
            block_tokens: trace.block_tokens,
        },
        pool_shards: args.pool_shards,
        endpoints: args.endpoint.clone(),
        namespace: args.namespace.clone(),
        density: parse_density(&args.density)?,
        sim: SimOptions {
            order: args.order,
            disk_admit: args.disk_admit,
        },
    };
    let specs = with_disk(
        grid(
            &args.engine,
            &args.policy,
            &capacities,
            &args.nodes,
            &args.scenario,
        ),
        &args.disk_ratio,
    );
    if specs.is_empty() {
        bail!("nothing to run: the pool engine only runs the lru policy");
    }
    eprintln!(
        "trace {}: {} requests, {} blocks ({} distinct) of {} tokens, {} bytes each; {} runs",
        setup.trace_name,
        trace.requests.len(),
        trace.total_blocks(),
        trace.distinct_blocks(),
        trace.block_tokens,
        block_bytes,
        specs.len()
    );
    let rows = replay_all(&setup, &specs)?;
    print_summary(&rows, &setup.ttft);
    write_outputs(args, &rows, &setup.trace_name)?;
    Ok(rows)
}

/// The trace to replay and its name in the rows: the synthetic workload asked for, or the
/// trace file (the bundled one by default).
fn load_trace(args: &ReplayArgs) -> anyhow::Result<(Trace, String)> {
    if let Some(w) = args.synthetic {
        let mut t = synth::generate(w, args.seed, args.requests);
        t.requests.truncate(args.limit.unwrap_or(usize::MAX));
        return Ok((t, format!("synthetic-{}-seed{}", w.name(), args.seed)));
    }
    let path = args
        .trace
        .clone()
        .unwrap_or_else(|| PathBuf::from(BUNDLED_TRACE));
    let t = Trace::load(
        &path,
        args.format,
        args.block_tokens,
        args.time_unit_ms,
        args.limit,
    )?;
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    Ok((t, name))
}

/// Bytes per block: `--block-bytes`, or the `--model`'s KV bytes per token times the trace's
/// tokens per block.
fn block_bytes(args: &ReplayArgs, trace: &Trace) -> anyhow::Result<u64> {
    if let Some(s) = &args.block_bytes {
        return parse_size(s).map_err(anyhow::Error::msg);
    }
    let per_token = MODELS
        .iter()
        .find(|(m, _)| *m == args.model)
        .map(|m| m.1)
        .with_context(|| {
            format!(
                "unknown model {:?}; known: {}",
                args.model,
                MODELS.iter().map(|m| m.0).collect::<Vec<_>>().join(", ")
            )
        })?;
    Ok(per_token * trace.block_tokens)
}

/// Capacities per node in blocks: `--capacity`, or `--capacity-bytes` divided into blocks.
fn capacities(args: &ReplayArgs, block_bytes: u64) -> anyhow::Result<Vec<u64>> {
    if args.capacity_bytes.is_empty() {
        return Ok(args.capacity.clone());
    }
    args.capacity_bytes
        .iter()
        .map(|s| Ok(parse_size(s).map_err(anyhow::Error::msg)? / block_bytes))
        .collect()
}

/// Replays the trace once per spec, with a progress bar per run; returns a row per spec.
fn replay_all(setup: &Setup<'_>, specs: &[RunSpec]) -> anyhow::Result<Vec<Row>> {
    let next = setup.next_uses();
    let style =
        ProgressStyle::with_template("{prefix:>36} [{bar:30}] {pos}/{len} requests {elapsed}")
            .expect("valid template")
            .progress_chars("=> ");
    let mut rows = Vec::new();
    for spec in specs {
        let bar = ProgressBar::new(setup.trace.requests.len() as u64).with_style(style.clone());
        let disk = match spec.disk_blocks {
            0 => String::new(),
            d => format!("+{d}"),
        };
        bar.set_prefix(format!(
            "{} {} {}x{}{disk} {}",
            spec.engine.name(),
            spec.policy.name(),
            spec.nodes,
            spec.capacity_blocks,
            spec.scenario.name()
        ));
        let row = setup.run(spec, &next, || bar.inc(1))?;
        bar.finish_and_clear();
        rows.push(row);
    }
    Ok(rows)
}

/// Writes replay.csv, replay.json and (unless `--no-plot`) the charts into `--out`, and says
/// which files it wrote.
fn write_outputs(args: &ReplayArgs, rows: &[Row], trace_name: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    write_csv(&args.out.join("replay.csv"), rows)?;
    write_json(&args.out.join("replay.json"), rows)?;
    let mut files = vec![args.out.join("replay.csv"), args.out.join("replay.json")];
    if !args.no_plot {
        files.extend(super::plot::hit_rate_charts(rows, &args.out, trace_name)?);
    }
    for f in files {
        eprintln!("wrote {}", f.display());
    }
    Ok(())
}

fn print_summary(rows: &[Row], ttft: &TtftModel) {
    print_table(rows);
    print_disk_comparison(rows);
    // Pooled versus private, where both ran.
    for p in rows
        .iter()
        .filter(|r| r.nodes > 1 && r.scenario == Scenario::Pooled)
    {
        if let Some(q) = rows.iter().find(|q| {
            q.scenario == Scenario::Private
                && q.nodes == p.nodes
                && q.policy == p.policy
                && q.engine == p.engine
                && q.capacity_blocks == p.capacity_blocks
        }) {
            let ratio = if q.block_hit_rate > 0.0 {
                p.block_hit_rate / q.block_hit_rate
            } else {
                f64::INFINITY
            };
            println!(
                "pooled vs private: {} {} nodes x {} blocks: {:.2}% vs {:.2}% = {:.2}x",
                p.policy.name(),
                p.nodes,
                p.capacity_blocks,
                p.block_hit_rate * 100.0,
                q.block_hit_rate * 100.0,
                ratio
            );
        }
    }
    if ttft.block_load_s() > ttft.block_recompute_s() {
        println!(
            "WARNING: loading a block ({:.2} ms at {:.1} GB/s) is slower than recomputing it ({:.2} ms at {:.0} tokens/s): with these parameters the cache slows prefill down",
            ttft.block_load_s() * 1e3,
            ttft.pool_bytes_per_s / 1e9,
            ttft.block_recompute_s() * 1e3,
            ttft.prefill_tokens_per_s
        );
    }
}

/// Each run over a disk tier against the same DRAM alone and the unbounded ceiling.
fn print_disk_comparison(rows: &[Row]) {
    for r in rows {
        let Some(d) = &r.disk else { continue };
        let same =
            |q: &&Row| q.engine == r.engine && q.nodes == r.nodes && q.scenario == r.scenario;
        let alone = rows.iter().filter(same).find(|q| {
            q.disk.is_none() && q.policy == r.policy && q.capacity_blocks == r.capacity_blocks
        });
        let ceiling = rows
            .iter()
            .filter(same)
            .find(|q| q.policy == Policy::Unbounded);
        let mut line = format!(
            "disk tier: {} {} blocks + {} on disk ({}): {:.2}% (DRAM {:.2}% + disk {:.2}%)",
            r.policy.name(),
            r.capacity_blocks,
            d.disk_capacity_blocks,
            d.disk_admit.name(),
            r.block_hit_rate * 100.0,
            d.dram_hit_rate * 100.0,
            d.disk_hit_rate * 100.0
        );
        if let Some(a) = alone {
            line += &format!(" vs DRAM alone {:.2}%", a.block_hit_rate * 100.0);
        }
        if let Some(c) = ceiling.filter(|c| c.block_hit_rate > 0.0) {
            line += &format!(
                "; {:.1}% of the unbounded {:.2}%",
                r.block_hit_rate / c.block_hit_rate * 100.0,
                c.block_hit_rate * 100.0
            );
        }
        line += &format!(
            "; {:.2} blocks written per block read from disk",
            d.disk_written_per_read
        );
        println!("{line}");
    }
}

/// One line per run; the disk tier's columns follow when some run has them.
fn print_table(rows: &[Row]) {
    let disk = rows.iter().any(|r| r.disk.is_some());
    let disk_header = if disk {
        format!(" {:>9} {:>8} {:>8} {:>6}", "disk", "dram%", "disk%", "w/r")
    } else {
        String::new()
    };
    println!(
        "{:<5} {:<12} {:>5} {:<8} {:>9} {:>8} {:>8} {:>11} {:>11}{disk_header}",
        "eng",
        "policy",
        "nodes",
        "scenario",
        "capacity",
        "block%",
        "token%",
        "ttft-nocache",
        "ttft-cache"
    );
    for r in rows {
        let cap = if r.capacity_blocks == 0 {
            "-".to_string()
        } else {
            r.capacity_blocks.to_string()
        };
        let disk_cells = match (&r.disk, disk) {
            (_, false) => String::new(),
            (None, true) => format!(" {:>9}", "-"),
            (Some(d), true) => format!(
                " {:>9} {:>7.2}% {:>7.2}% {:>6.2}",
                d.disk_capacity_blocks,
                d.dram_hit_rate * 100.0,
                d.disk_hit_rate * 100.0,
                d.disk_written_per_read
            ),
        };
        println!(
            "{:<5} {:<12} {:>5} {:<8} {:>9} {:>7.2}% {:>7.2}% {:>9.1}ms {:>9.1}ms{disk_cells}",
            r.engine.name(),
            r.policy.name(),
            r.nodes,
            if r.nodes == 1 {
                "-".to_string()
            } else {
                r.scenario.name()
            },
            cap,
            r.block_hit_rate * 100.0,
            r.token_hit_rate * 100.0,
            r.ttft_without_cache_ms,
            r.ttft_with_cache_ms
        );
    }
}
