//! `kvpool wait`, `fail`, `cancel` and `expire`: the handoff of docs/HANDOFF.md from the
//! command line.

use std::io::Write;
use std::time::Duration;

use kvpool_client::blocking::Client;

use crate::text::printable;

/// `kvpool wait`: exits 0 when every key is written, 1 when some are missing at the deadline,
/// 3 when some were failed.
pub(crate) fn wait(client: &Client, keys: &[Vec<u8>], wait_ms: u64) -> anyhow::Result<i32> {
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let timeout = Duration::from_millis(wait_ms);
    let got = client.block_on(client.async_client().wait(&refs, timeout))?;
    let mut out = std::io::stdout().lock();
    for k in &got.missing {
        writeln!(out, "{} missing", printable(k))?;
    }
    for (k, reason) in &got.failed {
        writeln!(out, "{} failed: {reason}", printable(k))?;
    }
    Ok(if !got.failed.is_empty() {
        3
    } else if !got.missing.is_empty() {
        1
    } else {
        0
    })
}

/// `kvpool expire`: prints how many keys are present.
pub(crate) fn expire(client: &Client, keys: &[Vec<u8>], ttl_ms: u64) -> anyhow::Result<i32> {
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let ttl = Duration::from_millis(ttl_ms);
    let n = client.block_on(client.async_client().expire(&refs, ttl))?;
    println!("{n}");
    Ok(0)
}

/// `kvpool fail`: prints how many tombstones were posted.
pub(crate) fn fail(client: &Client, keys: &[Vec<u8>], reason: &str) -> anyhow::Result<i32> {
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let n = client.block_on(client.async_client().fail(&refs, reason))?;
    println!("{n}");
    Ok(0)
}

/// `kvpool cancel`: prints how many objects and allocations were freed.
pub(crate) fn cancel(client: &Client, keys: &[Vec<u8>], reason: &str) -> anyhow::Result<i32> {
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let n = client.block_on(client.async_client().cancel(&refs, reason))?;
    println!("{n}");
    Ok(0)
}
