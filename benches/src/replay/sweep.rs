//! Grids of replays: every combination of engine, policy, capacity, node count and scenario,
//! with one row per run, written as CSV and JSON.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::bail;
use serde::Serialize;

use kvpool::eviction::{Density, DensityConfig, PolicyKind};

use super::cache::{Belady, BlockCache, Lru, Order, PoolPolicy, Unbounded};
use super::cluster::{Pooled, Private};
use super::pool_engine::{InProcess, Remote};
use super::tiers::{Admit, TwoTier};
use super::trace::Trace;
use super::ttft::TtftModel;
use super::{next_uses, replay};

/// Eviction policy of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Least recently used.
    Lru,
    /// Leaves-first LRU (`kvpool::eviction::PrefixAware`).
    PrefixAware,
    /// Adaptive S3-FIFO (`kvpool::eviction::S3Fifo`), main queue as in the paper.
    S3fifo,
    /// Adaptive S3-FIFO with its main queue in recency order, the pool's default.
    S3fifoLru,
    /// Hit density over classes of blocks (`kvpool::eviction::Density`).
    HitDensity,
    /// Belady's offline optimum (simulation only): the bound from below on misses.
    Belady,
    /// No eviction at all: the ceiling.
    Unbounded,
}

impl Policy {
    /// The pool's default policy (`PolicyKind::default()`), as a replay policy.
    pub fn pool_default() -> Policy {
        [
            Policy::Lru,
            Policy::PrefixAware,
            Policy::S3fifo,
            Policy::S3fifoLru,
            Policy::HitDensity,
        ]
        .into_iter()
        .find(|p| p.pool_policy() == Some(PolicyKind::default()))
        .expect("every pool policy is a replay policy")
    }

    /// The pool's implementation of this policy, if it has one.
    pub fn pool_policy(self) -> Option<PolicyKind> {
        match self {
            Policy::Lru => Some(PolicyKind::Lru),
            Policy::PrefixAware => Some(PolicyKind::PrefixAware),
            Policy::S3fifo => Some(PolicyKind::S3Fifo),
            Policy::S3fifoLru => Some(PolicyKind::S3FifoLru),
            Policy::HitDensity => Some(PolicyKind::HitDensity),
            Policy::Belady | Policy::Unbounded => None,
        }
    }
}

/// What executes a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Engine {
    /// Policy simulation: block ids only, fast.
    Sim,
    /// A real kvpool: in-process nodes, or the daemons given by `--endpoint`.
    Pool,
}

/// How several nodes serve the requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// One shared pool: blocks placed on nodes by rendezvous hashing.
    Pooled,
    /// Each node its own cache; requests spread round-robin.
    Private,
}

/// One run of a sweep.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSpec {
    /// Engine.
    pub engine: Engine,
    /// Policy.
    pub policy: Policy,
    /// Blocks per node.
    pub capacity_blocks: u64,
    /// Nodes.
    pub nodes: u32,
    /// Scenario (irrelevant for one node).
    pub scenario: Scenario,
    /// Blocks per node on a simulated disk tier under the DRAM one (0: no disk tier).
    pub disk_blocks: u64,
}

/// One result row (the CSV and JSON schema; docs/BENCHMARKS.md describes each column).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    /// Trace file name.
    pub trace: String,
    /// Engine.
    pub engine: Engine,
    /// Policy.
    pub policy: Policy,
    /// Scenario.
    pub scenario: Scenario,
    /// Nodes.
    pub nodes: u32,
    /// Blocks per node (0 for unbounded, or a remote pool of unknown size).
    pub capacity_blocks: u64,
    /// Bytes over all nodes.
    pub capacity_bytes: u64,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Tokens per block.
    pub block_tokens: u64,
    /// Requests replayed.
    pub requests: u64,
    /// Blocks accessed.
    pub blocks: u64,
    /// Blocks hit.
    pub hits: u64,
    /// hits / blocks.
    pub block_hit_rate: f64,
    /// Prefill tokens saved / prompt tokens.
    pub token_hit_rate: f64,
    /// Mean modelled TTFT without a cache, ms.
    pub ttft_without_cache_ms: f64,
    /// Mean modelled TTFT with the cache, ms.
    pub ttft_with_cache_ms: f64,
    /// Loading a block from the pool is slower than recomputing it.
    pub load_slower_than_recompute: bool,
    /// Wall time of the run, seconds.
    pub seconds: f64,
    /// The disk tier's figures, for runs with one (the columns appear only then).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub disk: Option<DiskRow>,
}

/// The columns of a run with a simulated disk tier.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DiskRow {
    /// Blocks per node on disk.
    pub disk_capacity_blocks: u64,
    /// Which evicted blocks were written to disk.
    pub disk_admit: Admit,
    /// Hits served from DRAM.
    pub dram_hits: u64,
    /// Hits served from disk (blocks read from disk).
    pub disk_hits: u64,
    /// dram_hits / blocks.
    pub dram_hit_rate: f64,
    /// disk_hits / blocks.
    pub disk_hit_rate: f64,
    /// Blocks written to disk.
    pub disk_writes: u64,
    /// disk_writes / disk_hits: bytes written per byte read from disk (0 when none was read).
    pub disk_written_per_read: f64,
}

/// The column names, in order.
pub const CSV_HEADER: &str = "trace,engine,policy,scenario,nodes,capacity_blocks,capacity_bytes,block_bytes,block_tokens,requests,blocks,hits,block_hit_rate,token_hit_rate,ttft_without_cache_ms,ttft_with_cache_ms,load_slower_than_recompute,seconds";

/// The columns added after [`CSV_HEADER`]'s when some run has a disk tier.
pub const CSV_DISK_HEADER: &str = "disk_capacity_blocks,disk_admit,dram_hits,disk_hits,dram_hit_rate,disk_hit_rate,disk_writes,disk_written_per_read";

/// How the simulation stores blocks, for every run of a sweep.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimOptions {
    /// The order in which a request's blocks are touched and inserted.
    pub order: Order,
    /// Which evicted blocks the disk tier takes.
    pub disk_admit: Admit,
}

/// Everything a sweep shares.
pub struct Setup<'a> {
    /// The trace.
    pub trace: &'a Trace,
    /// Its file name, for the rows.
    pub trace_name: String,
    /// Bytes per block (real bytes for the pool engine).
    pub block_bytes: u64,
    /// TTFT model.
    pub ttft: TtftModel,
    /// Index shards of in-process pool nodes.
    pub pool_shards: usize,
    /// Daemons to drive instead of in-process nodes (pool engine).
    pub endpoints: Vec<String>,
    /// Namespace on those daemons.
    pub namespace: String,
    /// Parameters of `hit-density` in the simulation (the pool engine runs the defaults).
    pub density: DensityConfig,
    /// Order and disk admission of the simulation.
    pub sim: SimOptions,
}

impl Setup<'_> {
    /// Builds the cache a run drives.
    pub fn cache(&self, spec: &RunSpec) -> anyhow::Result<Box<dyn BlockCache>> {
        let pool_policy = spec.policy.pool_policy();
        if spec.engine == Engine::Pool && pool_policy.is_none() {
            bail!("{:?} is simulation only; the pool engine runs the pool's own policies (lru, prefix-aware, s3fifo, s3fifo-lru, hit-density)", spec.policy);
        }
        if spec.disk_blocks > 0 {
            if spec.engine == Engine::Pool {
                bail!("the disk tier is simulated: --engine sim only");
            }
            if spec.nodes > 1 && spec.scenario == Scenario::Pooled {
                bail!("the simulated disk tier runs on one node or on private caches");
            }
        }
        let node = |_: u32| self.node(spec);
        let nodes: Vec<Box<dyn BlockCache>> = if spec.engine == Engine::Pool
            && !self.endpoints.is_empty()
        {
            // Distinct per run, also between runs of one process against the same daemons
            // (an `Instant` just taken has elapsed nothing, so it can't tell them apart).
            static RUNS: AtomicU32 = AtomicU32::new(0);
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            let run = RUNS
                .fetch_add(1, Ordering::Relaxed)
                .wrapping_mul(0x9e37_79b9);
            let tag = std::process::id().rotate_left(16) ^ nanos ^ run;
            // A cluster pools by itself: one client routes every block to its owner.
            let first =
                Remote::connect(&self.endpoints[0], &self.namespace, self.block_bytes, tag)?;
            if first.cluster_nodes()? > 1 {
                if spec.scenario == Scenario::Private {
                    bail!("{} belongs to a cluster: private caches need standalone daemons (one --endpoint each)", self.endpoints[0]);
                }
                return Ok(Box::new(first));
            }
            self.endpoints
                .iter()
                .map(|e| {
                    Ok(
                        Box::new(Remote::connect(e, &self.namespace, self.block_bytes, tag)?)
                            as Box<dyn BlockCache>,
                    )
                })
                .collect::<anyhow::Result<_>>()?
        } else {
            (0..spec.nodes).map(node).collect::<anyhow::Result<_>>()?
        };
        Ok(match nodes.len() {
            1 => nodes.into_iter().next().expect("one"),
            _ if spec.scenario == Scenario::Private => Box::new(Private::new(nodes)),
            _ => Box::new(Pooled::new(nodes)),
        })
    }

    /// One node of a run: the policy in DRAM, over a disk tier if the run has one.
    fn node(&self, spec: &RunSpec) -> anyhow::Result<Box<dyn BlockCache>> {
        let order = self.sim.order;
        let pool_policy = spec.policy.pool_policy();
        let cap = spec.capacity_blocks;
        let dram: Box<dyn BlockCache> = match (spec.engine, spec.policy) {
            (Engine::Sim, Policy::Lru) => Box::new(Lru::new(cap as usize).with_order(order)),
            (Engine::Sim, Policy::HitDensity) => Box::new(
                PoolPolicy::with_policy(Box::new(Density::new(self.density)), cap as usize)
                    .with_order(order),
            ),
            (Engine::Sim, Policy::PrefixAware | Policy::S3fifo | Policy::S3fifoLru) => Box::new(
                PoolPolicy::new(pool_policy.expect("a pool policy"), cap as usize)
                    .with_order(order),
            ),
            (Engine::Sim, Policy::Belady) => Box::new(Belady::new(cap as usize).with_order(order)),
            (Engine::Sim, Policy::Unbounded) => Box::new(Unbounded::default()),
            (Engine::Pool, _) => Box::new(InProcess::new(
                cap,
                self.block_bytes,
                self.pool_shards,
                pool_policy.expect("cache() runs the pool engine with pool policies only"),
            )?),
        };
        Ok(match spec.disk_blocks {
            0 => dram,
            disk => Box::new(TwoTier::new(dram, disk as usize, self.sim.disk_admit)?),
        })
    }

    /// Nodes behind the endpoints: a cluster's serving nodes, or one per standalone daemon.
    fn cluster_size(&self) -> anyhow::Result<u32> {
        let r = Remote::connect(&self.endpoints[0], &self.namespace, self.block_bytes, 0)?;
        Ok(match r.cluster_nodes()? {
            1 => self.endpoints.len() as u32,
            n => n as u32,
        })
    }

    /// Runs one spec.
    pub fn run(&self, spec: &RunSpec, next: &[u64], tick: impl FnMut()) -> anyhow::Result<Row> {
        let start = Instant::now();
        let mut cache = self.cache(spec)?;
        let o = replay(self.trace, cache.as_mut(), next, tick)?;
        let est = self.ttft.estimate(&o.per_request);
        let nodes = if spec.engine == Engine::Pool && !self.endpoints.is_empty() {
            self.cluster_size()?
        } else {
            spec.nodes
        };
        let disk = cache.tiers().map(|t| DiskRow {
            disk_capacity_blocks: spec.disk_blocks,
            disk_admit: self.sim.disk_admit,
            dram_hits: t.dram_hits,
            disk_hits: t.disk_hits,
            dram_hit_rate: super::ratio(t.dram_hits, o.blocks),
            disk_hit_rate: super::ratio(t.disk_hits, o.blocks),
            disk_writes: t.disk_writes,
            disk_written_per_read: super::ratio(t.disk_writes, t.disk_hits),
        });
        let remote = spec.engine == Engine::Pool && !self.endpoints.is_empty();
        let capacity_blocks = if spec.policy == Policy::Unbounded || remote {
            0
        } else {
            spec.capacity_blocks
        };
        Ok(Row {
            trace: self.trace_name.clone(),
            engine: spec.engine,
            policy: spec.policy,
            scenario: spec.scenario,
            nodes,
            capacity_blocks,
            capacity_bytes: capacity_blocks * self.block_bytes * nodes as u64,
            block_bytes: self.block_bytes,
            block_tokens: self.trace.block_tokens,
            requests: o.requests,
            blocks: o.blocks,
            hits: o.hits,
            block_hit_rate: o.block_hit_rate(),
            token_hit_rate: o.token_hit_rate(),
            ttft_without_cache_ms: est.without_cache_ms,
            ttft_with_cache_ms: est.with_cache_ms,
            load_slower_than_recompute: est.load_slower_than_recompute,
            seconds: start.elapsed().as_secs_f64(),
            disk,
        })
    }

    /// The flattened next-use table the runs share.
    pub fn next_uses(&self) -> Vec<u64> {
        next_uses(self.trace)
    }
}

/// The runs of a grid. Unbounded runs once per (engine, nodes, scenario), since capacity does
/// not apply; one-node runs once per capacity, since the scenario does not apply.
pub fn grid(
    engines: &[Engine],
    policies: &[Policy],
    capacities: &[u64],
    nodes: &[u32],
    scenarios: &[Scenario],
) -> Vec<RunSpec> {
    let mut out = Vec::new();
    for &engine in engines {
        for &n in nodes {
            let scenarios: &[Scenario] = if n == 1 {
                &scenarios[..1.min(scenarios.len())]
            } else {
                scenarios
            };
            for &scenario in scenarios {
                for &policy in policies {
                    if engine == Engine::Pool && policy.pool_policy().is_none() {
                        continue;
                    }
                    let caps: &[u64] = if policy == Policy::Unbounded {
                        &capacities[..1.min(capacities.len())]
                    } else {
                        capacities
                    };
                    for &capacity_blocks in caps {
                        out.push(RunSpec {
                            engine,
                            policy,
                            capacity_blocks,
                            nodes: n,
                            scenario: if n == 1 { Scenario::Pooled } else { scenario },
                            disk_blocks: 0,
                        });
                    }
                }
            }
        }
    }
    out
}

/// `specs`, each simulated run of a policy that reports its evictions followed by the same run
/// over a disk tier of `ratio` times its DRAM capacity, for each of `disk_ratios`.
pub fn with_disk(specs: Vec<RunSpec>, disk_ratios: &[f64]) -> Vec<RunSpec> {
    let mut out = Vec::new();
    for spec in specs {
        let tiered = spec.engine == Engine::Sim
            && !matches!(spec.policy, Policy::Belady | Policy::Unbounded)
            && (spec.nodes == 1 || spec.scenario == Scenario::Private);
        let disks: Vec<u64> = if tiered {
            disk_ratios
                .iter()
                .map(|r| (spec.capacity_blocks as f64 * r).round() as u64)
                .filter(|&d| d > 0)
                .collect()
        } else {
            Vec::new()
        };
        out.push(spec.clone());
        out.extend(disks.into_iter().map(|disk_blocks| RunSpec {
            disk_blocks,
            ..spec.clone()
        }));
    }
    out
}

/// Writes rows as CSV; the disk tier's columns follow when some row has them.
pub fn write_csv(path: &Path, rows: &[Row]) -> anyhow::Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    let disk_columns = rows.iter().any(|r| r.disk.is_some());
    if disk_columns {
        writeln!(f, "{CSV_HEADER},{CSV_DISK_HEADER}")?;
    } else {
        writeln!(f, "{CSV_HEADER}")?;
    }
    for r in rows {
        let name = |v: &dyn erased::Name| v.name();
        writeln!(
            f,
            "\"{}\",{},{},{},{},{},{},{},{},{},{},{},{:.6},{:.6},{:.3},{:.3},{},{:.3}{}",
            r.trace.replace('"', "\"\""),
            name(&r.engine),
            name(&r.policy),
            name(&r.scenario),
            r.nodes,
            r.capacity_blocks,
            r.capacity_bytes,
            r.block_bytes,
            r.block_tokens,
            r.requests,
            r.blocks,
            r.hits,
            r.block_hit_rate,
            r.token_hit_rate,
            r.ttft_without_cache_ms,
            r.ttft_with_cache_ms,
            r.load_slower_than_recompute,
            r.seconds,
            match (&r.disk, disk_columns) {
                (_, false) => String::new(),
                (None, true) =>
                    format!(",0,,{},0,{:.6},0.000000,0,0.000", r.hits, r.block_hit_rate),
                (Some(d), true) => format!(
                    ",{},{},{},{},{:.6},{:.6},{},{:.3}",
                    d.disk_capacity_blocks,
                    name(&d.disk_admit),
                    d.dram_hits,
                    d.disk_hits,
                    d.dram_hit_rate,
                    d.disk_hit_rate,
                    d.disk_writes,
                    d.disk_written_per_read
                ),
            }
        )?;
    }
    f.flush()?;
    Ok(())
}

/// Writes rows as a JSON array.
pub fn write_json(path: &Path, rows: &[Row]) -> anyhow::Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(rows)?)?;
    Ok(())
}

/// Lower-case names of the enums, as in the CSV.
pub mod erased {
    /// A value with a kebab-case name.
    pub trait Name {
        /// The name.
        fn name(&self) -> String;
    }

    impl<T: clap::ValueEnum> Name for T {
        fn name(&self) -> String {
            self.to_possible_value()
                .map(|v| v.get_name().to_string())
                .unwrap_or_default()
        }
    }
}
