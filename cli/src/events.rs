//! `kvpool events`: the namespace's KV events (keys stored in and removed from each tier of
//! every node), one line each, as a cache-aware router would consume them.

use std::io::Write;
use std::time::Duration;

use kvpool_client::blocking::Client;
use kvpool_client::KvEventBatch;

use crate::text::printable;

/// How a key is printed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Format {
    /// JSON lines instead of text.
    pub(crate) json: bool,
    /// Keys in hex.
    pub(crate) hex: bool,
}

/// Prints events until interrupted, or until `count` events (lag markers not counted) have
/// been printed. Exits 0.
pub(crate) fn run(
    client: &Client,
    prefix: &[u8],
    count: Option<u64>,
    fmt: Format,
) -> anyhow::Result<i32> {
    let mut sub = client.kv_events(prefix)?;
    let mut printed = 0;
    let mut out = std::io::stdout().lock();
    while count.is_none_or(|n| printed < n) {
        let Some(batch) = sub.next_within(Duration::from_secs(1)) else {
            continue;
        };
        let batch = batch?;
        let left = count.map_or(u64::MAX, |n| n - printed);
        printed += print(&mut out, &batch, left, fmt)?;
        out.flush()?;
    }
    Ok(0)
}

/// Prints `batch`'s lag marker, if any, then at most `left` of its events; how many events.
fn print(
    out: &mut impl Write,
    batch: &KvEventBatch,
    left: u64,
    fmt: Format,
) -> std::io::Result<u64> {
    if batch.dropped > 0 {
        if fmt.json {
            let line = serde_json::json!({
                "node": batch.node,
                "seq": batch.seq,
                "kind": "lagged",
                "dropped": batch.dropped,
            });
            writeln!(out, "{line}")?;
        } else {
            writeln!(
                out,
                "lagged node={} dropped={}: resynchronise",
                batch.node, batch.dropped
            )?;
        }
    }
    let mut n = 0;
    for (i, e) in batch.events.iter().enumerate().take(left as usize) {
        let key = if fmt.hex {
            e.key.iter().map(|b| format!("{b:02x}")).collect()
        } else {
            printable(&e.key)
        };
        let (kind, tier) = (e.kind.name(), e.tier.name());
        if fmt.json {
            let line = serde_json::json!({
                "node": batch.node,
                "seq": batch.seq + i as u64,
                "kind": kind,
                "tier": tier,
                "key": key,
            });
            writeln!(out, "{line}")?;
        } else {
            writeln!(out, "{kind} {tier} {key}")?;
        }
        n += 1;
    }
    Ok(n)
}
