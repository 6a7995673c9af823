//! Part 2 of `kvpool-bench handoff`: a producer's blocks handed to a consumer already waiting
//! for them, against one raw TCP stream of the same bytes.

use std::time::{Duration, Instant};

use anyhow::ensure;
use kvpool_bench::units::fmt_size;
use kvpool_client::{Client, ErrorCode, SameHost};

use super::{
    pair, path_name, HandoffArgs, Report, Row, Verdict, HANDOFF_GOAL, HANDOFF_SETTLE, WAIT_TIMEOUT,
};
use crate::perf::daemon::Daemon;
use crate::perf::workloads;
use crate::weights::alternate;
use crate::weights::limits::RawStream;

/// The table's heading.
const PART: &str = "handoff: producer to a waiting consumer, against a raw TCP stream";

/// The instants of one handoff.
struct Handoff {
    /// The producer's call.
    start: Instant,
    /// `batch_put_from` returned.
    stored: Instant,
    /// The consumer's `wait` returned.
    woke: Instant,
    /// The consumer holds every byte.
    done: Instant,
}

/// One handoff of `src` in blocks under `keys`: the consumer waits first, then the producer
/// stores, then the consumer reads into `dst` (handed back).
async fn handoff_once(
    producer: &Client,
    consumer: &Client,
    keys: &[Vec<u8>],
    src: &[u8],
    (block, streaming): (usize, bool),
    mut dst: Vec<Vec<u8>>,
) -> anyhow::Result<(Handoff, Vec<Vec<u8>>)> {
    let (c, ks) = (consumer.clone(), keys.to_vec());
    let task = tokio::spawn(async move {
        let refs: Vec<&[u8]> = ks.iter().map(|k| &k[..]).collect();
        if streaming {
            // Each block read the moment it is written, while the producer sends the rest.
            let mut dsts: Vec<&mut [u8]> = dst.iter_mut().map(|d| &mut d[..]).collect();
            let (out, got) = c.wait_get_into(&refs, &mut dsts, WAIT_TIMEOUT).await?;
            let done = Instant::now();
            ensure!(
                out.complete() && got.iter().all(|g| *g == Some(block)),
                "handoff: {} missing, {} failed, or a block short",
                out.missing.len(),
                out.failed.len()
            );
            drop(dsts);
            return anyhow::Ok((done, done, dst));
        }
        let out = c.wait(&refs, WAIT_TIMEOUT).await?;
        let woke = Instant::now();
        ensure!(
            out.complete(),
            "handoff: {} missing, {} failed",
            out.missing.len(),
            out.failed.len()
        );
        let mut dsts: Vec<&mut [u8]> = dst.iter_mut().map(|d| &mut d[..]).collect();
        let got = c.batch_get_into(&refs, &mut dsts).await?;
        let done = Instant::now();
        ensure!(
            got.iter().all(|g| *g == Some(block)),
            "handoff: a block is missing or short"
        );
        drop(dsts);
        anyhow::Ok((woke, done, dst))
    });
    tokio::time::sleep(HANDOFF_SETTLE).await;
    let items: Vec<(&[u8], &[u8])> = keys
        .iter()
        .zip(src.chunks(block))
        .map(|(k, v)| (&k[..], v))
        .collect();
    let start = Instant::now();
    let codes = producer.batch_put_from(&items).await?;
    let stored = Instant::now();
    ensure!(
        codes.iter().all(|c| *c == ErrorCode::Ok),
        "handoff put: {codes:?}"
    );
    let (woke, done, dst) = task.await??;
    Ok((
        Handoff {
            start,
            stored,
            woke,
            done,
        },
        dst,
    ))
}
/// Part 2: handoffs on one path against a raw TCP stream of the same bytes.
pub(super) fn handoff(
    args: &HandoffArgs,
    rt: &tokio::runtime::Runtime,
    d: &Daemon,
    same_host: SameHost,
    report: &mut Report,
) -> anyhow::Result<()> {
    let path = path_name(same_host);
    eprintln!("== {PART}, {path} ==");
    let Some((producer, consumer)) = pair(rt, d, same_host)? else {
        return Ok(());
    };
    let runs = measure(args, rt, &producer, &consumer)?;
    push_rows(args, path, &runs, report);
    if same_host == SameHost::Off {
        report.notes.push(format!(
            "handoff: medians (p50) of {} alternating runs per contender after one unrecorded \
             run; the consumer is in Client::wait {} ms before the producer's call; every byte \
             is checked after each run; the keys are removed between runs",
            args.reps,
            HANDOFF_SETTLE.as_millis()
        ));
    }
    Ok(())
}

/// What the measured loop timed.
struct Runs {
    /// The raw TCP stream next to the waiting consumer, and the waiting consumer.
    stream: Vec<Duration>,
    kv: Vec<Duration>,
    /// The raw TCP stream next to the streaming consumer, and the streaming consumer.
    stream2: Vec<Duration>,
    kv2: Vec<Duration>,
    /// Every handoff's instants: the warm-up, the waiting consumer's, the streaming one's.
    stages: Vec<Handoff>,
}

/// The measured loop: one unrecorded handoff, then `--reps` handoffs alternating with the raw
/// stream, the consumer waiting; then as many with the consumer reading as the blocks arrive.
fn measure(
    args: &HandoffArgs,
    rt: &tokio::runtime::Runtime,
    producer: &Client,
    consumer: &Client,
) -> anyhow::Result<Runs> {
    let block = args.block_size as usize;
    let blocks = (args.handoff_bytes / args.block_size) as usize;
    let src = workloads::value(args.handoff_bytes);
    // Written, so no run pays for faulting them in.
    let mut dst: Vec<Vec<u8>> = (0..blocks).map(|_| vec![0xa5; block]).collect();
    let mut rep = 0usize;
    let mut stages: Vec<Handoff> = Vec::new();
    let streaming = std::cell::Cell::new(false);
    let mut one = |dst: &mut Vec<Vec<u8>>| -> anyhow::Result<Duration> {
        let keys: Vec<Vec<u8>> = (0..blocks)
            .map(|i| format!("hbench-handoff/{rep}/{i:05}").into_bytes())
            .collect();
        rep += 1;
        let (h, back) = rt.block_on(handoff_once(
            producer,
            consumer,
            &keys,
            &src,
            (block, streaming.get()),
            std::mem::take(dst),
        ))?;
        *dst = back;
        for (i, d) in dst.iter().enumerate() {
            ensure!(
                d[..] == src[i * block..(i + 1) * block],
                "handoff: block {i} differs"
            );
        }
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        rt.block_on(producer.batch_remove(&refs))?;
        let took = h.done - h.start;
        stages.push(h);
        Ok(took)
    };
    // Unrecorded: opens the consumer's watching connection and the pooled connections.
    one(&mut dst)?;
    let mut raw = RawStream::start(src.clone(), 0)?;
    raw.receive(&mut dst)?;
    let (stream, kv) = alternate(args.reps, &mut dst, |dst| raw.receive(dst), &mut one)?;
    // The same, the consumer reading each block as it is written (Client::wait_get_into).
    streaming.set(true);
    let (stream2, kv2) = alternate(args.reps, &mut dst, |dst| raw.receive(dst), &mut one)?;
    drop(raw);
    Ok(Runs {
        stream,
        kv,
        stream2,
        kv2,
        stages,
    })
}

/// The rows of one path: the reference, each consumer judged against it, and the stages.
fn push_rows(args: &HandoffArgs, path: &str, runs: &Runs, report: &mut Report) {
    let bytes = args.handoff_bytes;
    let (reference, row, row2) = judged_rows(args, path, runs);
    // The first was the warm-up; then the waiting consumer's runs, then the streaming one's.
    let (stages, streamed) = runs.stages[1..].split_at(args.reps);
    let ns = |a: Instant, b: Instant| b.saturating_duration_since(a).as_nanos() as f64;
    let put: Vec<f64> = stages.iter().map(|h| ns(h.start, h.stored)).collect();
    let wake: Vec<f64> = stages.iter().map(|h| ns(h.start, h.woke)).collect();
    let get: Vec<f64> = stages.iter().map(|h| ns(h.woke, h.done)).collect();
    let put2: Vec<f64> = streamed.iter().map(|h| ns(h.start, h.stored)).collect();
    report.rows.push(reference);
    report.rows.push(row);
    report.rows.push(
        Row::from_times(
            PART,
            &format!("{path}:   stage: producer's batch_put_from"),
            &put,
        )
        .gbps(bytes),
    );
    report.rows.push(Row::from_times(
        PART,
        &format!("{path}:   stage: producer's call to the consumer's wake"),
        &wake,
    ));
    report.rows.push(
        Row::from_times(
            PART,
            &format!("{path}:   stage: consumer's batch_get_into"),
            &get,
        )
        .gbps(bytes),
    );
    report.rows.push(row2);
    report.rows.push(
        Row::from_times(
            PART,
            &format!("{path}:   stage: producer's batch_put_from, the consumer reading meanwhile"),
            &put2,
        )
        .gbps(bytes),
    );
}

/// The raw stream's reference row and the two consumers' rows judged against it.
fn judged_rows(args: &HandoffArgs, path: &str, runs: &Runs) -> (Row, Row, Row) {
    let secs = |t: &[Duration]| t.iter().map(|d| d.as_nanos() as f64).collect::<Vec<_>>();
    let bytes = args.handoff_bytes;
    let blocks = (args.handoff_bytes / args.block_size) as usize;
    let reference = Row::from_times(
        PART,
        &format!("{path}: raw TCP stream, 1 connection (reference)"),
        &secs(&[&runs.stream[..], &runs.stream2[..]].concat()),
    )
    .gbps(bytes);
    let judged = |what: String, times: &[Duration]| {
        let mut row = Row::from_times(PART, &what, &secs(times)).gbps(bytes);
        let ratio = row.p50_ns / reference.p50_ns;
        row.verdict = Some(Verdict {
            text: format!("{ratio:.2}× raw TCP; goal ≤{HANDOFF_GOAL}×"),
            ratio: Some(ratio),
            met: ratio <= HANDOFF_GOAL,
        });
        row
    };
    let size = fmt_size(args.block_size);
    let row = judged(
        format!("{path}: wait + batch_put_from + batch_get_into, {blocks} × {size}"),
        &runs.kv,
    );
    let row2 = judged(
        format!("{path}: batch_put_from + wait_get_into (reads as written), {blocks} × {size}"),
        &runs.kv2,
    );
    (reference, row, row2)
}
