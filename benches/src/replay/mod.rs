//! `kvpool-bench replay`: cache hit rates on real request traces.
//!
//! Semantics (docs/BENCHMARKS.md states them too): requests are taken in trace order. For each,
//! its *hits* are the leading run of its blocks present in the cache; then all its blocks are
//! stored — by default the present ones touched first, in order, then the missing ones inserted,
//! in order ([`cache::Order`] has the other order).
//! Block hit rate = hits / blocks. Token hit rate = tokens saved from prefill / prompt tokens,
//! where a hit block saves its block size in tokens except a partial last block, which saves
//! nothing.
//!
//! - [`trace`]: Mooncake and Qwen/Bailian JSONL traces;
//! - [`synth`]: deterministic synthetic prefix workloads in the same format;
//! - [`cache`]: the simulated policies (LRU, Belady, unbounded) and the order a request's
//!   blocks reach them;
//! - [`tiers`]: a simulated disk tier under the simulated DRAM one;
//! - [`pool_engine`]: the real pool, in-process or over the network;
//! - [`cluster`]: pooled versus private fleets;
//! - [`elastic`]: the hit rate around a node joining or draining, on real daemons in real time;
//! - [`ttft`]: time to first token with and without the cache;
//! - [`sweep`]: grids of runs, CSV and JSON; [`plot`]: PNG charts; [`cli`]: the subcommand.

pub mod cache;
pub mod cli;
pub mod cluster;
pub mod elastic;
pub mod plot;
pub mod pool_engine;
pub mod sweep;
pub mod synth;
pub mod tiers;
pub mod trace;
pub mod ttft;

use std::collections::HashMap;

use cache::BlockCache;
use trace::{saved_tokens, Trace};

/// What one replay measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    /// Requests replayed.
    pub requests: u64,
    /// Blocks over all requests.
    pub blocks: u64,
    /// Blocks found (leading runs).
    pub hits: u64,
    /// Prompt tokens over all requests.
    pub input_tokens: u64,
    /// Tokens saved from prefill.
    pub saved_tokens: u64,
    /// Per request: (prompt tokens, tokens saved, blocks loaded), for the TTFT model.
    pub per_request: Vec<(u64, u64, u64)>,
}

impl Outcome {
    /// hits / blocks.
    pub fn block_hit_rate(&self) -> f64 {
        ratio(self.hits, self.blocks)
    }

    /// saved tokens / prompt tokens.
    pub fn token_hit_rate(&self) -> f64 {
        ratio(self.saved_tokens, self.input_tokens)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// For every block access (requests in order, blocks in order, flattened), the position of the
/// next access of the same block, or `u64::MAX`. What Belady needs.
pub fn next_uses(trace: &Trace) -> Vec<u64> {
    let n = trace.total_blocks() as usize;
    let mut next = vec![u64::MAX; n];
    let mut last: HashMap<u64, u64> = HashMap::new();
    let flat: Vec<u64> = trace
        .requests
        .iter()
        .flat_map(|r| r.blocks.iter().copied())
        .collect();
    for i in (0..n).rev() {
        if let Some(&j) = last.get(&flat[i]) {
            next[i] = j;
        }
        last.insert(flat[i], i as u64);
    }
    next
}

/// Replays `trace` against `cache`. `next` comes from [`next_uses`]; `tick` is called after
/// every request (progress bars).
pub fn replay(
    trace: &Trace,
    cache: &mut dyn BlockCache,
    next: &[u64],
    mut tick: impl FnMut(),
) -> anyhow::Result<Outcome> {
    let mut o = Outcome {
        per_request: Vec::with_capacity(trace.requests.len()),
        ..Outcome::default()
    };
    let mut pos = 0usize;
    for r in &trace.requests {
        let n = r.blocks.len();
        let hits = cache.lookup(&r.blocks)?;
        cache.store(&r.blocks, &next[pos..pos + n])?;
        pos += n;
        let saved = saved_tokens(r, hits, trace.block_tokens);
        o.requests += 1;
        o.blocks += n as u64;
        o.hits += hits as u64;
        o.input_tokens += r.input_tokens;
        o.saved_tokens += saved;
        o.per_request.push((r.input_tokens, saved, hits as u64));
        tick();
    }
    Ok(o)
}

#[cfg(test)]
mod tests;
