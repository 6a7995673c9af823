//! Synthetic prefix workloads: deterministic traces of structurally different LLM serving
//! patterns, in the same shape as the bundled Mooncake trace (512-token blocks, each block id
//! standing for its chained prefix hash, ids dense in order of first appearance).
//!
//! They exist so that eviction policies can be judged on traces they were not tuned on. Each
//! [`Workload`] is a small generative model of one pattern, seeded, with no dependence on the
//! bundled trace:
//!
//! - [`Workload::Chat`]: multi-turn conversations, each growing by one turn per request, under
//!   Zipf-popular system prompts, many conversations interleaved;
//! - [`Workload::Rag`]: document QA: a few long documents, Zipf-popular, each asked many distinct
//!   short questions;
//! - [`Workload::Agent`]: agentic tool loops: long contexts that grow by a tool result per step
//!   and are re-read whole at every step, a few agents at a time;
//! - [`Workload::Scan`]: a hot set of few-shot prompts under a stream of one-shot long documents
//!   (batch summarisation) that are never seen again.
//!
//! Blocks are interned by `(parent block, content)`, so two prompts share exactly their common
//! prefix of blocks, as a real prefix hash would make them. A prompt's last block is partial
//! (its content is unique to the request), as in the real traces.

use std::collections::HashMap;
use std::io::Write;

use super::trace::{Request, Trace, TraceFormat};

/// Tokens per block, as in the Mooncake trace.
pub const BLOCK_TOKENS: u64 = 512;

/// The synthetic workloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Workload {
    /// Multi-turn chat: conversations growing turn by turn, Zipf-popular system prompts.
    Chat,
    /// Document QA / RAG: few long shared documents, many distinct short questions.
    Rag,
    /// Agentic tool loops: long growing contexts re-read at every step.
    Agent,
    /// A hot set of few-shot prompts under a stream of one-shot long documents.
    Scan,
}

impl Workload {
    /// Every workload.
    pub const ALL: [Workload; 4] = [
        Workload::Chat,
        Workload::Rag,
        Workload::Agent,
        Workload::Scan,
    ];

    /// Its name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Workload::Chat => "chat",
            Workload::Rag => "rag",
            Workload::Agent => "agent",
            Workload::Scan => "scan",
        }
    }
}

/// Generates `requests` requests of `workload` from `seed`. The same arguments always give the
/// same trace.
pub fn generate(workload: Workload, seed: u64, requests: usize) -> Trace {
    let mut g = Gen {
        rng: Rng::new(seed ^ (workload as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)),
        ids: HashMap::new(),
        content: 0,
        clock_ms: 0,
        out: Vec::with_capacity(requests),
    };
    match workload {
        Workload::Chat => chat(&mut g, requests),
        Workload::Rag => rag(&mut g, requests),
        Workload::Agent => agent(&mut g, requests),
        Workload::Scan => scan(&mut g, requests),
    }
    Trace {
        requests: g.out,
        block_tokens: BLOCK_TOKENS,
        format: TraceFormat::Mooncake,
    }
}

/// Writes `trace` as Mooncake JSONL (the bundled trace's format).
pub fn write_jsonl(trace: &Trace, w: &mut impl Write) -> std::io::Result<()> {
    for r in &trace.requests {
        let ids: Vec<String> = r.blocks.iter().map(u64::to_string).collect();
        writeln!(
            w,
            "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": {}, \"hash_ids\": [{}]}}",
            r.arrival_ms,
            r.input_tokens,
            r.output_tokens,
            ids.join(", ")
        )?;
    }
    Ok(())
}

/// Multi-turn chat. About 60 conversations are open at once; each request is the next turn of
/// a random open one: its system prompt (one of 30, Zipf 1.0, 1 to 6 blocks), every earlier
/// turn (user message and answer) and the new message. Conversations last 1 to 12 turns.
fn chat(g: &mut Gen, requests: usize) {
    let prompts: Vec<Vec<u64>> = (0..30)
        .map(|_| {
            let n = g.rng.range(1, 6);
            g.fresh_contents(n)
        })
        .collect();
    let zipf = Zipf::new(prompts.len(), 1.0);
    struct Conv {
        context: Vec<u64>,
        turns_left: u64,
    }
    let mut open: Vec<Conv> = Vec::new();
    while g.out.len() < requests {
        while open.len() < 60 {
            let p = zipf.sample(&mut g.rng);
            open.push(Conv {
                context: prompts[p].clone(),
                turns_left: g.rng.range(1, 12),
            });
        }
        let i = g.rng.below(open.len() as u64) as usize;
        let c = &mut open[i];
        let message = g.rng.range(1, 3);
        let mut prompt = c.context.clone();
        prompt.extend(g.fresh_contents(message));
        let answer_tokens = g.rng.range(100, 900);
        g.emit(&prompt, answer_tokens, 400);
        // The next turn sees this message and the answer. The message's partial last block is
        // completed by the answer's first tokens, so its content (and hash) changes.
        prompt.pop();
        c.context = prompt;
        c.context
            .extend(g.fresh_contents(1 + answer_tokens / BLOCK_TOKENS));
        c.turns_left -= 1;
        if c.turns_left == 0 {
            open.swap_remove(i);
        }
    }
}

/// Document QA: one system prompt (2 blocks), then one of 40 documents (8 to 40 blocks, Zipf
/// 0.8), then a distinct question (1 block).
fn rag(g: &mut Gen, requests: usize) {
    let system = g.fresh_contents(2);
    let docs: Vec<Vec<u64>> = (0..40)
        .map(|_| {
            let n = g.rng.range(8, 40);
            g.fresh_contents(n)
        })
        .collect();
    let zipf = Zipf::new(docs.len(), 0.8);
    while g.out.len() < requests {
        let d = zipf.sample(&mut g.rng);
        let mut prompt = system.clone();
        prompt.extend(&docs[d]);
        prompt.extend(g.fresh_contents(1));
        let answer = g.rng.range(50, 400);
        g.emit(&prompt, answer, 300);
    }
}

/// Agentic tool loops: 6 agents at a time, each a shared system prompt with tool descriptions
/// (one of 3, 6 blocks each), a task (2 blocks), then 10 to 40 steps that each append a tool
/// call and its result (1 to 4 blocks) and re-read the whole context.
fn agent(g: &mut Gen, requests: usize) {
    let harnesses: Vec<Vec<u64>> = (0..3).map(|_| g.fresh_contents(6)).collect();
    struct Task {
        context: Vec<u64>,
        steps_left: u64,
    }
    let mut open: Vec<Task> = Vec::new();
    while g.out.len() < requests {
        while open.len() < 6 {
            let h = g.rng.below(harnesses.len() as u64) as usize;
            let mut context = harnesses[h].clone();
            context.extend(g.fresh_contents(2));
            open.push(Task {
                context,
                steps_left: g.rng.range(10, 40),
            });
        }
        let i = g.rng.below(open.len() as u64) as usize;
        let t = &mut open[i];
        let result = g.rng.range(1, 4);
        t.context.extend(g.fresh_contents(result));
        let mut prompt = t.context.clone();
        prompt.extend(g.fresh_contents(1));
        let answer = g.rng.range(30, 300);
        g.emit(&prompt, answer, 150);
        t.steps_left -= 1;
        if t.steps_left == 0 {
            open.swap_remove(i);
        }
    }
}

/// Scan-heavy mix: half the requests use one of 200 few-shot prompts (4 to 10 blocks, Zipf 1.0)
/// with a distinct 1-block question; the other half summarise a document seen once (20 to 60
/// blocks).
fn scan(g: &mut Gen, requests: usize) {
    let shots: Vec<Vec<u64>> = (0..200)
        .map(|_| {
            let n = g.rng.range(4, 10);
            g.fresh_contents(n)
        })
        .collect();
    let zipf = Zipf::new(shots.len(), 1.0);
    while g.out.len() < requests {
        if g.rng.below(2) == 0 {
            let s = zipf.sample(&mut g.rng);
            let mut prompt = shots[s].clone();
            prompt.extend(g.fresh_contents(1));
            let answer = g.rng.range(20, 200);
            g.emit(&prompt, answer, 200);
        } else {
            let n = g.rng.range(20, 60);
            let prompt = g.fresh_contents(n);
            let answer = g.rng.range(200, 600);
            g.emit(&prompt, answer, 200);
        }
    }
}

/// Generator state: the random stream, the block interner and the trace so far.
struct Gen {
    rng: Rng,
    /// Block id of each (parent block id + 1, or 0 at the root; content) seen.
    ids: HashMap<(u64, u64), u64>,
    /// Contents handed out so far.
    content: u64,
    clock_ms: u64,
    out: Vec<Request>,
}

impl Gen {
    /// `n` contents never used before.
    fn fresh_contents(&mut self, n: u64) -> Vec<u64> {
        let first = self.content;
        self.content += n;
        (first..self.content).collect()
    }

    /// Appends a request whose prompt is `contents` (the last block partial), arriving a random
    /// gap of mean `gap_ms` after the previous one.
    fn emit(&mut self, contents: &[u64], output_tokens: u64, gap_ms: u64) {
        let mut parent = 0;
        let blocks: Vec<u64> = contents
            .iter()
            .map(|&c| {
                let next = self.ids.len() as u64;
                let id = *self.ids.entry((parent, c)).or_insert(next);
                parent = id + 1;
                id
            })
            .collect();
        let partial = self.rng.range(1, BLOCK_TOKENS);
        self.clock_ms += self.rng.below(2 * gap_ms + 1);
        self.out.push(Request {
            arrival_ms: self.clock_ms,
            input_tokens: (blocks.len() as u64 - 1) * BLOCK_TOKENS + partial,
            output_tokens,
            blocks,
        });
    }
}

/// splitmix64: tiny, fast, and the same on every platform (also the soak benchmark's).
pub struct Rng(u64);

impl Rng {
    /// The generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf over `0..n`: item `k` with probability proportional to `1 / (k + 1)^s`.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, s: f64) -> Self {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (0..n)
            .map(|k| {
                acc += 1.0 / ((k + 1) as f64).powf(s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }

    fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.unit();
        self.cdf
            .partition_point(|&c| c <= u)
            .min(self.cdf.len() - 1)
    }
}
