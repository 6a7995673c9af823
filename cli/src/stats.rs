//! `kvpool stats`: the node's statistics, as text or JSON.

use kvpool_client::blocking::Client;
use serde_json::json;

/// `kvpool stats`: as JSON with `json`.
pub(crate) fn show(client: &Client, json: bool) -> anyhow::Result<i32> {
    let s = client.stats()?;
    let disk = client.disk_stats()?;
    if json {
        let mut out = stats_json(&s);
        out["disk"] = serde_json::to_value(&disk)?;
        println!("{out}");
    } else {
        print_stats(&s, client.is_local());
        match &disk {
            Some(d) => print_disk(d),
            None => println!("disk tier: off"),
        }
    }
    Ok(0)
}

/// The disk tier's lines of `kvpool stats`: what it holds, what reached it and came back.
fn print_disk(d: &kvpool::protocol::DiskTierStats) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!(
        "disk tier: {} objects, {:.3} / {:.3} GiB, hits {}  misses {}",
        d.objects,
        gib(d.bytes),
        gib(d.capacity),
        d.hits,
        d.misses
    );
    println!(
        "  demoted {} ({:.3} GiB)  already on disk {}  not admitted {}  over share {}  \
         queue drops {}  write failures {}",
        d.demoted,
        gib(d.demoted_bytes),
        d.already_on_disk,
        d.not_admitted,
        d.share_refused,
        d.queue_drops,
        d.write_failures
    );
    println!(
        "  promoted {} ({:.3} GiB)  promotion failures {}  read {:.3} GiB  written {:.3} GiB",
        d.promoted,
        gib(d.promoted_bytes),
        d.promotion_failures,
        gib(d.bytes_read),
        gib(d.bytes_written)
    );
    println!(
        "  checksum failures {}  io errors {}  regions dropped {}  queued {:.3} GiB",
        d.checksum_failures,
        d.io_errors,
        d.regions_dropped,
        gib(d.queued_bytes)
    );
}

fn print_stats(s: &kvpool::pool::PoolStats, local: bool) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!(
        "node {}{}",
        s.node,
        if local { " (same host: mapped)" } else { "" }
    );
    println!(
        "objects {}  pending {}  hits {}  misses {}  evictions {}",
        s.objects, s.pending, s.hits, s.misses, s.evictions
    );
    for seg in &s.segments {
        println!(
            "segment {}: {:.3} / {:.3} GiB used, {} blocks, fragmentation {:.1}%",
            seg.id,
            gib(seg.used_bytes),
            gib(seg.capacity),
            seg.live_blocks,
            seg.external_fragmentation * 100.0
        );
    }
    for n in &s.namespaces {
        let quota = if n.quota_bytes == u64::MAX {
            "none".to_string()
        } else {
            format!("{:.3} GiB", gib(n.quota_bytes))
        };
        println!(
            "namespace {:?}: {} objects, {:.3} GiB used, {:.3} GiB pinned, quota {}",
            n.name,
            n.objects,
            gib(n.used_bytes),
            gib(n.pinned_bytes),
            quota
        );
    }
}

/// `kvpool stats --json`: the node's statistics as one JSON object.
fn stats_json(s: &kvpool::pool::PoolStats) -> serde_json::Value {
    let segments: Vec<_> = s
        .segments
        .iter()
        .map(|g| {
            json!({
                "id": g.id,
                "capacity": g.capacity,
                "used_bytes": g.used_bytes,
                "free_bytes": g.free_bytes,
                "live_blocks": g.live_blocks,
                "largest_free_run": g.largest_free_run,
                "external_fragmentation": g.external_fragmentation,
            })
        })
        .collect();
    let namespaces: Vec<_> = s
        .namespaces
        .iter()
        .map(|n| {
            json!({
                "name": n.name,
                "id": n.id,
                "quota_bytes": n.quota_bytes,
                "used_bytes": n.used_bytes,
                "pinned_bytes": n.pinned_bytes,
                "objects": n.objects,
            })
        })
        .collect();
    json!({
        "node": s.node,
        "objects": s.objects,
        "pending": s.pending,
        "hits": s.hits,
        "misses": s.misses,
        "evictions": s.evictions,
        "commits": s.commits,
        "reaped": s.reaped,
        "segments": segments,
        "namespaces": namespaces,
    })
}
