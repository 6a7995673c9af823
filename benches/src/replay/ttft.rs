//! A first-order model of time to first token: prefill computes the tokens the cache did not
//! supply at `prefill_tokens_per_s`, and the cached blocks are loaded from the pool at
//! `pool_bytes_per_s`. Loading only pays when a block loads faster than it recomputes.

/// The model's parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TtftModel {
    /// Prefill throughput of the engine, tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Bandwidth from the pool into the engine, bytes per second.
    pub pool_bytes_per_s: f64,
    /// Bytes of one block.
    pub block_bytes: u64,
    /// Tokens of one block.
    pub block_tokens: u64,
}

/// Mean TTFT with and without the cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TtftEstimate {
    /// Mean TTFT without a cache, ms.
    pub without_cache_ms: f64,
    /// Mean TTFT with the cache, ms.
    pub with_cache_ms: f64,
    /// True when loading a block from the pool takes longer than recomputing it: the cache then
    /// slows requests down, and an engine should recompute instead.
    pub load_slower_than_recompute: bool,
}

impl TtftModel {
    /// Seconds to load one block from the pool.
    pub fn block_load_s(&self) -> f64 {
        self.block_bytes as f64 / self.pool_bytes_per_s
    }

    /// Seconds to recompute one block.
    pub fn block_recompute_s(&self) -> f64 {
        self.block_tokens as f64 / self.prefill_tokens_per_s
    }

    /// The estimate over `(prompt tokens, tokens saved, blocks loaded)` per request.
    pub fn estimate(&self, per_request: &[(u64, u64, u64)]) -> TtftEstimate {
        let n = per_request.len().max(1) as f64;
        let (mut without, mut with) = (0.0, 0.0);
        for &(input, saved, loaded) in per_request {
            without += input as f64 / self.prefill_tokens_per_s;
            with += (input - saved.min(input)) as f64 / self.prefill_tokens_per_s
                + loaded as f64 * self.block_load_s();
        }
        TtftEstimate {
            without_cache_ms: without / n * 1e3,
            with_cache_ms: with / n * 1e3,
            load_slower_than_recompute: self.block_load_s() > self.block_recompute_s(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loading_is_worth_it_only_when_faster_than_recompute() {
        // 512-token blocks of 64 MiB; prefill 10k tok/s recomputes a block in 51 ms.
        let fast = TtftModel {
            prefill_tokens_per_s: 10_000.0,
            pool_bytes_per_s: 10e9,
            block_bytes: 64 << 20,
            block_tokens: 512,
        };
        let e = fast.estimate(&[(1024, 512, 1)]);
        assert!((e.without_cache_ms - 102.4).abs() < 1e-9);
        assert!((e.with_cache_ms - (51.2 + 6.7108864)).abs() < 1e-6);
        assert!(!e.load_slower_than_recompute);
        let slow = TtftModel {
            pool_bytes_per_s: 1e9,
            ..fast
        };
        assert!(slow.estimate(&[(1024, 512, 1)]).load_slower_than_recompute);
    }
}
