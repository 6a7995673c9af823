//! `kvpool-bench`: kvpool's benchmarks, one subcommand each.
//!
//! - `perf`: throughput and latency of every data path (same-host one-sided reads, TCP, QUIC),
//!   the allocator and the index, each figure next to its physical limit or a baseline (memcpy,
//!   memcached, redis, bare quinn) measured in the same run with the same parameters.
//! - `replay`: cache hit rates on real request traces, simulated policies and a real kvpool
//!   side by side, bounded by Belady's optimum and an unbounded cache (`kvpool_bench::replay`).
//! - `weights`: publishing and loading model weights (a generated safetensors checkpoint)
//!   next to reading the file, memcpy and a raw TCP stream of the same bytes, in the same run.
//! - `handoff`: the handoff figures: a 4 KiB get's p50 and p99 idle and under a bulk load (kvpool,
//!   redis, memcached), a producer-to-consumer handoff against a raw TCP stream, and the latency
//!   of a wait's notification against one round trip, all in the same run.
//! - `restart`: restart time: a pool of a million objects recovered from the
//!   segment files and journal a stopped node left.
//! - `soak`: a mixed load at saturation against a pool that runs full, with
//!   the daemon's RSS, open descriptors and pending allocations sampled and judged for
//!   flatness after the warm-up, and every read checked.
//! - `elastic`: the hit rate in the minutes around a node joining or draining, real
//!   daemons replaying a trace in real time, against a control run without the event.
//! - `disk`: the disk tier's reads and writes of large blocks through the store, over the
//!   buffered and the `O_DIRECT` engine, against `fio` on the same file system in the same run.
//! - `tier`: the disk tier on real daemons: DRAM gets while it demotes at full rate against
//!   the same gets without it, and the time to serve again after a restart with many objects
//!   on disk.
//! - `events`: put throughput with a KV event subscriber reading everything against none, in
//!   alternating pairs of windows, and the events per second it is sent.
//! - `scale`: a pool of 64 nodes on this machine, with static peers and with etcd: how long
//!   every view takes to converge after a start, a join, a drain and a kill, the coordination
//!   traffic per node, the share of keys a join and a drain move against 1/N, the routing cost
//!   at 3 and 64 nodes, and a node's memory per object.
//! - `gen-trace`: deterministic synthetic prefix workloads in the same JSONL format.
//!
//! Every run is bounded in time and stops by itself; nothing here asserts on time.

mod disk;
mod events;
mod fabric;
mod handoff;
mod heap;
mod perf;
mod restart;
mod scale;
mod soak;
mod tier;
mod weights;

use clap::{Parser, Subcommand};

/// Counts live heap bytes exactly (for the index's bytes per object); otherwise the system
/// allocator.
#[global_allocator]
static HEAP: heap::Counting = heap::Counting;

#[derive(Parser, Debug)]
#[command(name = "kvpool-bench", version, about = "kvpool benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Throughput and latency of kvpool against memcpy, memcached, redis and bare QUIC, all
    /// measured in the same run; prints tables and optionally writes JSON.
    Perf(perf::PerfArgs),
    /// Cache hit rates on a request trace: policies and capacities, simulated and on a real
    /// kvpool, with Belady and unbounded bounds, pooled versus private fleets and a TTFT model;
    /// writes CSV, JSON and PNG charts.
    Replay(Box<kvpool_bench::replay::cli::ReplayArgs>),
    /// The hit rate window by window around a cluster event (a node joining or draining) on
    /// real daemons replaying a trace in real time; a run without an event is the control.
    Elastic(kvpool_bench::replay::elastic::ElasticArgs),
    /// Writes a deterministic synthetic prefix workload (chat, rag, agent, scan) as JSONL in the
    /// bundled trace's format.
    GenTrace(kvpool_bench::replay::cli::GenTraceArgs),
    /// Model weights: publish and load a generated safetensors checkpoint against reading the
    /// file, memcpy and a raw TCP stream of the same bytes, all measured in the same run.
    Weights(weights::WeightsArgs),
    /// Handoffs and interference: a 4 KiB get idle and under bulk load against
    /// redis and memcached, a 64 MiB handoff to a waiting consumer against a raw TCP stream,
    /// and notification latency against one round trip, all measured in the same run.
    Handoff(handoff::HandoffArgs),
    /// Restart time: a node's objects recovered from the segment files and journal
    /// its previous life left, every one checked by its checksum.
    Restart(restart::RestartArgs),
    /// The disk tier: large blocks written and read through the disk store over the buffered
    /// and the O_DIRECT engine, against fio on the same file system, all in the same run.
    Disk(disk::DiskArgs),
    /// Soak: a mixed load at saturation for minutes against a pool that runs full;
    /// the daemon's RSS, open descriptors and pending allocations sampled and judged for
    /// flatness, every read checked.
    Soak(soak::SoakArgs),
    /// The disk tier on real daemons: DRAM gets while it demotes at full rate against the same
    /// gets without it, and the time to serve again after a restart with many objects on disk.
    Tier(tier::TierArgs),
    /// A pool of many nodes on this machine (64 by default), with static peers and with etcd:
    /// time for every view to converge after a start, a join, a drain and a kill; coordination
    /// traffic per node; the share of keys a join and a drain move against 1/N; routing cost at
    /// 3 nodes and at N; memory per object of one node.
    Scale(scale::ScaleArgs),
    /// KV events: 64 KiB puts at full rate with a subscriber reading every event against none,
    /// in alternating pairs of windows; events per second sent and the put throughput ratio.
    Events(events::EventsArgs),
    /// One-sided reads over libfabric providers (tcp, shm) through kvpool's fabric layer,
    /// against a bare fi_read loop over the same provider and kvpool's own TCP and same-host
    /// gets, all in the same run.
    Fabric(fabric::FabricArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Perf(args) => perf::run(args),
        Command::Replay(args) => kvpool_bench::replay::cli::run(&args).map(|_| ()),
        Command::Elastic(args) => kvpool_bench::replay::elastic::run(&args),
        Command::GenTrace(args) => kvpool_bench::replay::cli::gen_trace(&args),
        Command::Weights(args) => weights::run(args),
        Command::Handoff(args) => handoff::run(args),
        Command::Restart(args) => restart::run(args),
        Command::Soak(args) => soak::run(args),
        Command::Disk(args) => disk::run(args),
        Command::Tier(args) => tier::run(args),
        Command::Events(args) => events::run(args),
        Command::Fabric(args) => fabric::run(args),
        Command::Scale(args) => scale::run(args),
    }
}
