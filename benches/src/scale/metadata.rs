//! What one object costs a node besides its bytes: a `kvpoold` alone, filled with objects of one
//! size, its anonymous resident memory (`RssAnon`: the index, the allocator's tables, the
//! journal's buffers; the segment is shared memory and counted apart as `RssShmem`) read before
//! and after, and the segment bytes it reserved per object (the allocator's rounding) from its
//! own stats.

use std::time::Duration;

use anyhow::{bail, Context};
use kvpool_client::{Client, ErrorCode};

use crate::perf::daemon::Daemon;

use super::fleet::poll_cfg;

/// One fill's figures.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PerObject {
    pub(crate) size: u64,
    pub(crate) objects: u64,
    /// Growth of `RssAnon` per object, bytes.
    pub(crate) anon: f64,
    /// Segment bytes reserved per object.
    pub(crate) reserved: f64,
    /// `RssAnon` of the empty node, bytes.
    pub(crate) anon_empty: u64,
}

fn rss_anon(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    text.lines()
        .find_map(|l| {
            l.strip_prefix("RssAnon:")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .map_or(0, |kib: u64| kib << 10)
}

/// Fills a node of `memory` bytes with objects of `size` to about 85 % and measures.
pub(crate) async fn measure(
    bin: &std::path::Path,
    memory: u64,
    size: u64,
) -> anyhow::Result<PerObject> {
    let extra: Vec<String> = ["--huge-pages", "off"].map(String::from).to_vec();
    let d = Daemon::start_with(bin, memory, &extra)?;
    let c = Client::connect(&format!("tcp://{}", d.tcp), poll_cfg()).await?;
    // Let the node finish starting before the first reading.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let anon_empty = rss_anon(d.pid());
    let objects = memory * 85 / 100 / size;
    let value = vec![0x5au8; size as usize];
    let per_batch = ((16u64 << 20) / size).clamp(1, 256) as usize;
    let keys: Vec<Vec<u8>> = (0..objects)
        .map(|i| format!("meta/{size}/{i:010}").into_bytes())
        .collect();
    for chunk in keys.chunks(per_batch) {
        let items: Vec<(&[u8], &[u8])> = chunk.iter().map(|k| (&k[..], &value[..])).collect();
        let codes = c.batch_put_from(&items).await.context("filling")?;
        if let Some(code) = codes.iter().find(|c| **c != ErrorCode::Ok) {
            bail!("filling with {size}-byte objects: {code:?}");
        }
    }
    let stats = c.node_stats(0).await?;
    if stats.objects != objects {
        bail!(
            "the node holds {} objects of the {objects} written",
            stats.objects
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let anon_full = rss_anon(d.pid());
    Ok(PerObject {
        size,
        objects,
        anon: anon_full.saturating_sub(anon_empty) as f64 / objects as f64,
        reserved: stats.used_bytes() as f64 / objects as f64,
        anon_empty,
    })
}
