//! The replay traces' JSONL parser (benches/src/replay/trace.rs), compiled here from its own
//! source file rather than through the kvpool-bench crate, whose plotting dependencies would
//! double the fuzz build for one parser.
//!
//! The first input byte picks the format, block size, time unit and limit. Asserts: no panic;
//! a trace read is within what was asked (the limit, a non-zero block size); a Mooncake trace
//! read in milliseconds, written back as JSONL, reads back to the same requests (decode,
//! encode, decode); reading allocates no more than a multiple of the input.
#![no_main]

#[allow(dead_code, unreachable_pub, reason = "only `Trace::read` is fuzzed")]
#[path = "../../benches/src/replay/trace.rs"]
mod trace;

use kvpool_fuzz::{peak, Counting};
use libfuzzer_sys::fuzz_target;
use trace::{Trace, TraceFormat};

#[global_allocator]
static ALLOC: Counting = Counting;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, input)) = data.split_first() else {
        return;
    };
    let format = [TraceFormat::Auto, TraceFormat::Mooncake, TraceFormat::Qwen][mode as usize % 3];
    let block_tokens = (mode & 0x4 != 0).then_some(u64::from(mode >> 5));
    let unit = (mode & 0x8 != 0).then_some(f64::from(mode >> 4) * 0.25);
    let limit = (mode & 0x10 != 0).then_some(usize::from(mode >> 6));
    let (read, held) = peak(|| Trace::read(input, format, block_tokens, unit, limit));
    assert!(
        held <= 64 * input.len() + (16 << 10),
        "{held} bytes allocated reading {}",
        input.len()
    );
    let Ok(t) = read else { return };
    assert!(t.block_tokens >= 1);
    assert!(limit.is_none_or(|l| t.requests.len() <= l));
    assert!(t.distinct_blocks() <= t.total_blocks());
    let Ok(t) = Trace::read(input, TraceFormat::Mooncake, None, Some(1.0), None) else {
        return;
    };
    let mut jsonl = String::new();
    for r in &t.requests {
        let line = serde_json::json!({
            "timestamp": r.arrival_ms,
            "input_length": r.input_tokens,
            "output_length": r.output_tokens,
            "hash_ids": r.blocks,
        });
        jsonl.push_str(&line.to_string());
        jsonl.push('\n');
    }
    let again = Trace::read(
        jsonl.as_bytes(),
        TraceFormat::Mooncake,
        None,
        Some(1.0),
        None,
    )
    .expect("a trace we wrote reads back");
    assert_eq!(again.requests, t.requests);
});
