//! Phase 2 of `kvpool-bench weights`: two kvpoolds as one pool over loopback TCP; a warm load
//! against one raw TCP stream of the same bytes, and the load's stages timed on their own.

use std::path::Path;
use std::time::Instant;

use anyhow::ensure;
use futures_util::future::join_all;
use kvpool::weights::{Manifest, DEFAULT_NAMESPACE};
use kvpool_client::weights::{PublishOptions, Weights};
use kvpool_client::{Client, ClientConfig, Located, SameHost};

use super::report::{Report, Row};
use super::stages::{check, chunks, hash_all, latencies, lookup, targets};
use super::{alternate, limits, Model, WeightsArgs, MODEL, READS_IN_FLIGHT, TCP_GOAL};
use crate::perf::daemon;

/// The phase's heading.
const PHASE: &str = "loopback TCP: 2 kvpoolds as one pool, same-host path off";

/// Phase 2: two daemons over loopback TCP.
pub(super) fn over_tcp(
    args: &WeightsArgs,
    rt: &tokio::runtime::Runtime,
    bin: &Path,
    model: &Model,
    dst: &mut [Vec<u8>],
    report: &mut Report,
) -> anyhow::Result<()> {
    eprintln!("== {PHASE} ==");
    // Each node holds a copy of every chunk (pinned_replicas = 2).
    let (nodes, _) =
        crate::perf::cluster::start_daemons(rt, bin, 2, daemon::memory_for(model.bytes))?;
    let cfg = ClientConfig {
        same_host: SameHost::Off,
        ..ClientConfig::default()
    };
    let kv = rt.block_on(Client::connect(&format!("tcp://{}", nodes[0].tcp), cfg))?;
    let w = Weights::new(&kv, DEFAULT_NAMESPACE)?;
    let t = Instant::now();
    rt.block_on(w.publish(
        MODEL,
        std::slice::from_ref(&model.path),
        &PublishOptions::default(),
    ))?;
    let published = t.elapsed();
    report.rows.push(Row::new(
        PHASE,
        &format!(
            "Weights::publish, cold, {} copies",
            w.client().pinned_replicas()
        ),
        model.bytes,
        &[published],
    ));
    let m = rt.block_on(w.require(MODEL))?;
    load_against_stream(args, rt, (&w, &m), model, dst, report)?;
    load_breakdown(rt, (&w, &m), model, dst, report)?;
    latencies(PHASE, args, rt, &w, &m, report)?;
    drop(nodes);
    Ok(())
}

/// A warm load_into alternating with one raw TCP stream of the same bytes.
fn load_against_stream(
    args: &WeightsArgs,
    rt: &tokio::runtime::Runtime,
    (w, m): (&Weights, &Manifest),
    model: &Model,
    dst: &mut [Vec<u8>],
    report: &mut Report,
) -> anyhow::Result<()> {
    let mut raw = limits::RawStream::start(model.file.clone(), model.tensors[0].0)?;
    let (stream, load) = alternate(
        args.reps,
        dst,
        |dst| raw.receive(dst),
        |dst| {
            let mut t = targets(m, dst);
            let start = Instant::now();
            let r = rt.block_on(w.load_into(m, &mut t, None))?;
            let took = start.elapsed();
            ensure!(r.bytes_from_pool == model.bytes, "load: {r:?}");
            Ok(took)
        },
    )?;
    drop(raw);
    check(model, dst, "TCP load_into")?;
    let stream = Row::new(
        PHASE,
        "raw TCP stream, 1 connection (reference)",
        model.bytes,
        &stream,
    );
    let load = Row::new(PHASE, "Weights::load_into, warm", model.bytes, &load).versus(
        "raw TCP",
        &stream,
        Some(TCP_GOAL),
    );
    report.rows.push(stream);
    report.rows.push(load);
    Ok(())
}

/// Where a TCP load spends its time: the lookups, the reads without the hash, the hash.
fn load_breakdown(
    rt: &tokio::runtime::Runtime,
    (w, m): (&Weights, &Manifest),
    model: &Model,
    dst: &mut [Vec<u8>],
    report: &mut Report,
) -> anyhow::Result<()> {
    let chunk_list = chunks(m);
    let keys: Vec<Vec<u8>> = chunk_list.iter().map(|c| c.0.clone()).collect();
    let t = Instant::now();
    let located = rt.block_on(lookup(w.client(), &keys))?;
    let looked = t.elapsed();
    report.rows.push(
        Row::new(
            PHASE,
            &format!("  stage: lookup of {} chunks", keys.len()),
            0,
            &[looked],
        )
        .latency(),
    );
    let t = Instant::now();
    rt.block_on(read_unhashed(w.client(), &chunk_list, &located, dst))?;
    let reads = t.elapsed();
    report.rows.push(Row::new(
        PHASE,
        &format!("  stage: reads alone, {READS_IN_FLIGHT} in flight, no hash"),
        model.bytes,
        &[reads],
    ));
    check(model, dst, "TCP reads")?;
    let hashed = hash_all(dst, &chunk_list);
    report.rows.push(Row::new(
        PHASE,
        "  stage: xxh3 alone",
        model.bytes,
        &[hashed],
    ));
    Ok(())
}

/// The loader's TCP reads without its hash: groups of [`READS_IN_FLIGHT`] at once.
async fn read_unhashed(
    kv: &Client,
    chunk_list: &[(Vec<u8>, usize, usize, usize)],
    located: &[Located],
    dst: &mut [Vec<u8>],
) -> anyhow::Result<()> {
    let mut work: Vec<(&mut [u8], &Located)> = Vec::with_capacity(located.len());
    let mut rest: Vec<&mut [u8]> = dst.iter_mut().map(|d| &mut d[..]).collect();
    // Chunks come in tensor order and, within a tensor, in order: cut each buffer front to back.
    for ((_, ti, b, e), l) in chunk_list.iter().zip(located) {
        let buf = std::mem::take(&mut rest[*ti]);
        let (head, tail) = buf.split_at_mut(e - b);
        rest[*ti] = tail;
        work.push((head, l));
    }
    while !work.is_empty() {
        let take = work.len().min(READS_IN_FLIGHT);
        let batch: Vec<_> = work.drain(..take).collect();
        for ok in join_all(batch.into_iter().map(|(d, l)| kv.read(&l.addr, 0, d))).await {
            ensure!(ok?, "a chunk went missing");
        }
    }
    Ok(())
}
