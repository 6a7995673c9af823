//! Request traces: Mooncake's JSONL (`timestamp` in ms, `input_length`, `output_length`,
//! `hash_ids` of 512-token blocks) and Alibaba's Qwen/Bailian variant (`chat_id`,
//! `parent_chat_id`, `turn`, `type`, `timestamp` in seconds, 16-token blocks).

use std::io::BufRead;
use std::path::Path;

use anyhow::{bail, Context};
use serde::Deserialize;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Arrival, ms since the trace began.
    pub arrival_ms: u64,
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Completion tokens.
    pub output_tokens: u64,
    /// The prompt's blocks: ids standing for chained prefix hashes (the last may be partial).
    pub blocks: Vec<u64>,
}

/// Which shape the lines have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TraceFormat {
    /// Decide from the first line: `chat_id` means Qwen, otherwise Mooncake.
    Auto,
    /// Mooncake (FAST'25): 512-token blocks, timestamps in ms.
    Mooncake,
    /// Alibaba Qwen/Bailian: 16-token blocks, timestamps in seconds.
    Qwen,
}

impl TraceFormat {
    /// Tokens per block the format implies.
    pub fn default_block_tokens(self) -> u64 {
        match self {
            TraceFormat::Qwen => 16,
            _ => 512,
        }
    }

    /// Milliseconds per timestamp unit the format implies.
    pub fn default_time_unit_ms(self) -> f64 {
        match self {
            TraceFormat::Qwen => 1000.0,
            _ => 1.0,
        }
    }
}

/// A loaded trace.
#[derive(Clone, Debug)]
pub struct Trace {
    /// Requests in arrival order (file order).
    pub requests: Vec<Request>,
    /// Tokens per block.
    pub block_tokens: u64,
    /// The format it was read as.
    pub format: TraceFormat,
}

#[derive(Deserialize)]
struct Line {
    timestamp: f64,
    input_length: u64,
    #[serde(default)]
    output_length: u64,
    hash_ids: Vec<u64>,
    #[serde(default)]
    chat_id: Option<serde_json::Value>,
}

impl Trace {
    /// Reads a JSONL trace. `block_tokens` and `time_unit_ms` default to what the format implies;
    /// `limit` keeps only the first requests.
    pub fn load(
        path: &Path,
        format: TraceFormat,
        block_tokens: Option<u64>,
        time_unit_ms: Option<f64>,
        limit: Option<usize>,
    ) -> anyhow::Result<Trace> {
        let file = std::fs::File::open(path)
            .with_context(|| format!("opening trace {}", path.display()))?;
        Self::read(
            std::io::BufReader::new(file),
            format,
            block_tokens,
            time_unit_ms,
            limit,
        )
        .with_context(|| format!("reading trace {}", path.display()))
    }

    /// Reads a JSONL trace from any reader (see [`Trace::load`]).
    pub fn read(
        r: impl BufRead,
        mut format: TraceFormat,
        block_tokens: Option<u64>,
        time_unit_ms: Option<f64>,
        limit: Option<usize>,
    ) -> anyhow::Result<Trace> {
        let mut requests = Vec::new();
        let mut unit = time_unit_ms;
        for (i, line) in r.lines().enumerate() {
            if limit.is_some_and(|l| requests.len() >= l) {
                break;
            }
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            let l: Line = serde_json::from_str(&line).with_context(|| format!("line {}", i + 1))?;
            if format == TraceFormat::Auto {
                format = if l.chat_id.is_some() {
                    TraceFormat::Qwen
                } else {
                    TraceFormat::Mooncake
                };
            }
            let unit = *unit.get_or_insert(format.default_time_unit_ms());
            if l.timestamp.is_nan() || l.timestamp < 0.0 {
                bail!("line {}: negative or NaN timestamp", i + 1);
            }
            requests.push(Request {
                arrival_ms: (l.timestamp * unit).round() as u64,
                input_tokens: l.input_length,
                output_tokens: l.output_length,
                blocks: l.hash_ids,
            });
        }
        if format == TraceFormat::Auto {
            format = TraceFormat::Mooncake;
        }
        let block_tokens = block_tokens.unwrap_or(format.default_block_tokens());
        if block_tokens == 0 {
            bail!("block size must be at least one token");
        }
        Ok(Trace {
            requests,
            block_tokens,
            format,
        })
    }

    /// Total blocks over all requests.
    pub fn total_blocks(&self) -> u64 {
        self.requests.iter().map(|r| r.blocks.len() as u64).sum()
    }

    /// Distinct block ids.
    pub fn distinct_blocks(&self) -> u64 {
        let mut seen = std::collections::HashSet::new();
        self.requests
            .iter()
            .flat_map(|r| &r.blocks)
            .filter(|b| seen.insert(**b))
            .count() as u64
    }
}

/// Tokens a request saves from prefill when its first `hits` blocks come from the cache: whole
/// blocks only (a partial last block saves nothing).
pub fn saved_tokens(r: &Request, hits: usize, block_tokens: u64) -> u64 {
    (hits as u64).min(r.input_tokens / block_tokens) * block_tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_both_formats_with_their_units() {
        let mooncake = r#"{"timestamp": 1500, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}"#;
        let t = Trace::read(mooncake.as_bytes(), TraceFormat::Auto, None, None, None).unwrap();
        assert_eq!(t.format, TraceFormat::Mooncake);
        assert_eq!(t.block_tokens, 512);
        assert_eq!(
            t.requests[0],
            Request {
                arrival_ms: 1500,
                input_tokens: 1100,
                output_tokens: 5,
                blocks: vec![0, 1, 2]
            }
        );
        let qwen = "{\"chat_id\": 7, \"parent_chat_id\": -1, \"turn\": 1, \"type\": \"text\", \"timestamp\": 2.5, \"input_length\": 40, \"output_length\": 9, \"hash_ids\": [11, 12, 13]}\n\n";
        let t = Trace::read(qwen.as_bytes(), TraceFormat::Auto, None, None, None).unwrap();
        assert_eq!(t.format, TraceFormat::Qwen);
        assert_eq!(t.block_tokens, 16);
        assert_eq!(t.requests[0].arrival_ms, 2500);
        let t = Trace::read(
            qwen.as_bytes(),
            TraceFormat::Qwen,
            Some(32),
            Some(1.0),
            Some(1),
        )
        .unwrap();
        assert_eq!((t.block_tokens, t.requests[0].arrival_ms), (32, 3));
        assert!(Trace::read(
            "{\"timestamp\": 1}".as_bytes(),
            TraceFormat::Auto,
            None,
            None,
            None
        )
        .is_err());
    }

    #[test]
    fn partial_blocks_save_nothing() {
        let r = Request {
            arrival_ms: 0,
            input_tokens: 1100,
            output_tokens: 0,
            blocks: vec![0, 1, 2],
        };
        assert_eq!(saved_tokens(&r, 0, 512), 0);
        assert_eq!(saved_tokens(&r, 2, 512), 1024);
        assert_eq!(
            saved_tokens(&r, 3, 512),
            1024,
            "the third block holds 76 tokens: partial"
        );
    }
}
