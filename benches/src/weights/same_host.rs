//! Phase 1 of `kvpool-bench weights`: one kvpoold on this host, the client on the same-host
//! path; a cold publish against reading the file, a warm load against memcpy, and the stages
//! of each timed on their own.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use kvpool::weights::{Manifest, DEFAULT_NAMESPACE};
use kvpool_client::weights::{PublishOptions, Weights};
use kvpool_client::{Client, ClientConfig};

use super::report::{Report, Row};
use super::stages::{check, chunks, hash_all, latencies, lookup, targets};
use super::{
    alternate, limits, Model, WeightsArgs, BATCH_BYTES, KEYS_PER_REQUEST, LOCAL_GOAL, MODEL,
    PUBLISH_GOAL,
};
use crate::perf::daemon::{self, Daemon};

/// The phase's heading.
const PHASE: &str = "same host: 1 kvpoold, Unix socket and mapped segments";

/// Phase 1: one daemon, same host.
pub(super) fn same_host(
    args: &WeightsArgs,
    rt: &tokio::runtime::Runtime,
    bin: &Path,
    model: &mut Model,
    dst: &mut [Vec<u8>],
    report: &mut Report,
) -> anyhow::Result<()> {
    eprintln!("== {PHASE} ==");
    let d = Daemon::start(bin, daemon::memory_for(model.bytes))?;
    let kv = rt.block_on(Client::connect(
        &format!("tcp://{}", d.tcp),
        ClientConfig::default(),
    ))?;
    if !kv.is_local() {
        report.notes.push(
            "the client did not take the same-host path (segments not mappable here): \
             the same-host rows are over the daemon's socket"
                .into(),
        );
    }
    let w = Weights::new(&kv, DEFAULT_NAMESPACE)?;
    let publish_missed = publish_against_read(args, rt, bin, model, report)?;
    rt.block_on(w.publish(
        MODEL,
        std::slice::from_ref(&model.path),
        &PublishOptions::default(),
    ))?;
    let m = rt.block_on(w.require(MODEL))?;
    let chunk_list = chunks(&m);
    publish_breakdown(rt, &w, model, &m, &chunk_list, report)?;
    if publish_missed {
        report.notes.push(
            "publish: a reader thread reads and hashes each chunk while the runtime stores the \
             previous 64 MiB batch (presence check, then pinned put); the breakdown rows time \
             those stages alone on the same bytes"
                .into(),
        );
    }
    load_against_memcpy(args, rt, (&w, &m), model, dst, report)?;
    load_breakdown(rt, &w, model, &chunk_list, dst, report)?;
    latencies(PHASE, args, rt, &w, &m, report)?;
    rt.block_on(w.remove(MODEL))?;
    drop(d);
    Ok(())
}

/// A cold publish alternating with a read() of the whole file; whether it missed its goal.
/// Each publish goes to a daemon started for it, so that every one writes into memory the
/// daemon never used (the pages a removed model leaves are already there).
fn publish_against_read(
    args: &WeightsArgs,
    rt: &tokio::runtime::Runtime,
    bin: &Path,
    model: &mut Model,
    report: &mut Report,
) -> anyhow::Result<bool> {
    let paths = [model.path.clone()];
    let file_len = model.file.len() as u64;
    let path = model.path.clone();
    let memory = daemon::memory_for(model.bytes);
    let (read, publish) = alternate(
        args.reps,
        model.file_mut(),
        |buf| limits::read_file(&path, buf),
        |_| {
            let d = Daemon::start(bin, memory)?;
            let kv = rt.block_on(Client::connect(
                &format!("tcp://{}", d.tcp),
                ClientConfig::default(),
            ))?;
            let w = Weights::new(&kv, DEFAULT_NAMESPACE)?;
            let t = Instant::now();
            rt.block_on(w.publish(MODEL, &paths, &PublishOptions::default()))?;
            Ok(t.elapsed())
        },
    )?;
    let read = Row::new(PHASE, "read() of the file (reference)", file_len, &read);
    let publish = Row::new(
        PHASE,
        "Weights::publish, cold (a fresh daemon each run)",
        model.bytes,
        &publish,
    )
    .versus("file read", &read, Some(PUBLISH_GOAL));
    let publish_missed = publish.missed();
    report.rows.push(read);
    report.rows.push(publish);
    Ok(publish_missed)
}

/// A warm load_into alternating with memcpy between buffers of the tensors' sizes.
fn load_against_memcpy(
    args: &WeightsArgs,
    rt: &tokio::runtime::Runtime,
    (w, m): (&Weights, &Manifest),
    model: &Model,
    dst: &mut [Vec<u8>],
    report: &mut Report,
) -> anyhow::Result<()> {
    let src = model.sources();
    let (copy, load) = alternate(
        args.reps,
        dst,
        |dst| Ok(limits::memcpy(&src, dst)),
        |dst| {
            let mut t = targets(m, dst);
            let start = Instant::now();
            let r = rt.block_on(w.load_into(m, &mut t, None))?;
            let took = start.elapsed();
            ensure!(r.bytes_from_pool == model.bytes, "load: {r:?}");
            Ok(took)
        },
    )?;
    check(model, dst, "same-host load_into")?;
    let copy = Row::new(
        PHASE,
        "memcpy, buffer to buffer (reference)",
        model.bytes,
        &copy,
    );
    let load = Row::new(PHASE, "Weights::load_into, warm", model.bytes, &load).versus(
        "memcpy",
        &copy,
        Some(LOCAL_GOAL),
    );
    report.rows.push(copy);
    report.rows.push(load);
    Ok(())
}

/// Where a same-host load spends its time: the lookup, the copy with the hash in the same
/// pass, the copy alone, the hash alone.
fn load_breakdown(
    rt: &tokio::runtime::Runtime,
    w: &Weights,
    model: &Model,
    chunk_list: &[(Vec<u8>, usize, usize, usize)],
    dst: &mut [Vec<u8>],
    report: &mut Report,
) -> anyhow::Result<()> {
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
    if w.client().is_local() {
        let t = Instant::now();
        for ((_, ti, b, e), l) in chunk_list.iter().zip(&located) {
            w.client()
                .read_local_verified(l, &mut dst[*ti][*b..*e])
                .context("not mapped")??;
        }
        let verified = t.elapsed();
        let t = Instant::now();
        for ((_, ti, b, e), l) in chunk_list.iter().zip(&located) {
            w.client()
                .read_local(&l.addr, 0, &mut dst[*ti][*b..*e])
                .context("not mapped")?
                .map_err(|f| anyhow::anyhow!("read_local: {f:?}"))?;
        }
        let plain = t.elapsed();
        report.rows.push(Row::new(
            PHASE,
            "  stage: copy + xxh3 in one pass (read_local_verified)",
            model.bytes,
            &[verified],
        ));
        report.rows.push(Row::new(
            PHASE,
            "  stage: copy alone (read_local)",
            model.bytes,
            &[plain],
        ));
    }
    let hashed = hash_all(dst, chunk_list);
    report.rows.push(Row::new(
        PHASE,
        "  stage: xxh3 alone",
        model.bytes,
        &[hashed],
    ));
    Ok(())
}

/// The publisher's stages on their own: read() in chunks, xxh3 of each, and storing them
/// (presence check and pinned put, 64 MiB per batch) from memory.
fn publish_breakdown(
    rt: &tokio::runtime::Runtime,
    w: &Weights,
    model: &mut Model,
    m: &Manifest,
    chunk_list: &[(Vec<u8>, usize, usize, usize)],
    report: &mut Report,
) -> anyhow::Result<()> {
    let read = time_read(model, chunk_list)?;
    let hashed = time_hash(model, chunk_list);
    // The model's own chunks must go first, or the pool would need room for two copies.
    rt.block_on(w.remove(MODEL))?;
    let stored = time_store(rt, w.client(), model, chunk_list)?;
    // Back as it was for the loads.
    rt.block_on(w.publish(
        MODEL,
        std::slice::from_ref(&model.path),
        &PublishOptions::default(),
    ))?;
    ensure!(
        rt.block_on(w.require(MODEL))? == *m,
        "republished another manifest"
    );
    let n = chunk_list.len();
    report.rows.push(Row::new(
        PHASE,
        &format!("  stage: read() in {n} chunks"),
        model.bytes,
        &[read],
    ));
    report.rows.push(Row::new(
        PHASE,
        "  stage: xxh3 of each chunk",
        model.bytes,
        &[hashed],
    ));
    report.rows.push(Row::new(
        PHASE,
        "  stage: store (present + batch_put_pinned, 64 MiB batches)",
        model.bytes,
        &[stored],
    ));
    Ok(())
}

/// read() of the file chunk by chunk into the model's buffer.
fn time_read(
    model: &mut Model,
    chunk_list: &[(Vec<u8>, usize, usize, usize)],
) -> anyhow::Result<Duration> {
    let data_start = model.tensors[0].0;
    let t = Instant::now();
    let mut f = std::fs::File::open(&model.path)?;
    f.seek(SeekFrom::Start(data_start as u64))?;
    for (_, ti, b, e) in chunk_list {
        let (at, _) = model.tensors[*ti];
        f.read_exact(&mut model.file_mut()[at + b..at + e])?;
    }
    Ok(t.elapsed())
}

/// xxh3 of each chunk in the model's buffer.
fn time_hash(model: &Model, chunk_list: &[(Vec<u8>, usize, usize, usize)]) -> Duration {
    let t = Instant::now();
    for (_, ti, b, e) in chunk_list {
        let (at, _) = model.tensors[*ti];
        std::hint::black_box(kvpool::checksum::checksum(&model.file[at + b..at + e]));
    }
    t.elapsed()
}

/// Stores every chunk from memory under keys of its own, as the publisher batches them (a
/// presence check, then a pinned put per 64 MiB); then removes them again.
fn time_store(
    rt: &tokio::runtime::Runtime,
    kv: &Client,
    model: &Model,
    chunk_list: &[(Vec<u8>, usize, usize, usize)],
) -> anyhow::Result<Duration> {
    let keys: Vec<Vec<u8>> = (0..chunk_list.len())
        .map(|i| format!("bench-store/{i}").into_bytes())
        .collect();
    let t = Instant::now();
    let mut i = 0;
    while i < chunk_list.len() {
        let mut end = i;
        let mut bytes = 0;
        while end < chunk_list.len()
            && (end == i || bytes + (chunk_list[end].3 - chunk_list[end].2) as u64 <= BATCH_BYTES)
        {
            bytes += (chunk_list[end].3 - chunk_list[end].2) as u64;
            end += 1;
        }
        let items: Vec<(&[u8], &[u8])> = (i..end)
            .map(|j| {
                let (_, ti, b, e) = &chunk_list[j];
                let (at, _) = model.tensors[*ti];
                (&keys[j][..], &model.file[at + b..at + e])
            })
            .collect();
        let refs: Vec<&[u8]> = items.iter().map(|x| x.0).collect();
        rt.block_on(kv.present(&refs))?;
        let codes = rt.block_on(kv.batch_put_pinned(&items))?;
        ensure!(
            codes.iter().all(|c| *c == kvpool::protocol::ErrorCode::Ok),
            "store: {codes:?}"
        );
        i = end;
    }
    let stored = t.elapsed();
    for group in keys.chunks(KEYS_PER_REQUEST) {
        let refs: Vec<&[u8]> = group.iter().map(|k| &k[..]).collect();
        rt.block_on(kv.batch_remove(&refs))?;
    }
    Ok(stored)
}
