//! Part 3 of `kvpool-bench handoff`: a wait's notification of one small key, against an
//! `exists` and a 4 KiB get of the same run.

use std::time::Instant;

use anyhow::ensure;
use kvpool_bench::units::fmt_ns;
use kvpool_client::{Client, SameHost};

use super::{
    pair, path_name, HandoffArgs, Report, Row, Verdict, NOTIFY_SETTLE, NOTIFY_SLACK_NS, PROBE_SIZE,
    WAIT_TIMEOUT,
};
use crate::perf::daemon::Daemon;
use crate::perf::workloads;

/// The table's heading.
const PART: &str = "notification: put's call to the waiting consumer's wake, one small key";

/// One notification: returns (put's call to the wait's return, the put's own round trip).
async fn notify_once(
    producer: &Client,
    consumer: &Client,
    key: &[u8],
    value: &[u8],
) -> anyhow::Result<(f64, f64)> {
    let (c, k) = (consumer.clone(), key.to_vec());
    let task = tokio::spawn(async move {
        let out = c.wait(&[&k[..]], WAIT_TIMEOUT).await?;
        let woke = Instant::now();
        ensure!(out.complete(), "notification: the key did not arrive");
        anyhow::Ok(woke)
    });
    tokio::time::sleep(NOTIFY_SETTLE).await;
    let start = Instant::now();
    producer.put(key, value).await?;
    let stored = Instant::now();
    let woke = task.await??;
    producer.remove(key).await?;
    let ns = |a: Instant, b: Instant| b.saturating_duration_since(a).as_nanos() as f64;
    Ok((ns(start, woke), ns(start, stored)))
}

/// Part 3: notification latency on one path, against round trips of the same run.
pub(super) fn notification(
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
    let times = measure(args, rt, &producer, &consumer)?;
    push_rows(path, &times, report);
    if same_host == SameHost::Off {
        report.notes.push(format!(
            "notification: {} repetitions per path after one unrecorded, producer and consumer \
             in this process with their own clients (one clock); the consumer is in \
             Client::wait {} ms before the put of a 64-byte value; exists, the 4 KiB get and a put \
             of an unwatched key are the producer's, alternating before and after the \
             notification; the goal is judged \
             at p50",
            args.notify_reps,
            NOTIFY_SETTLE.as_millis()
        ));
    }
    Ok(())
}

/// The times of each recorded repetition, in ns.
struct Times {
    /// The put's call to the wait's return.
    notify: Vec<f64>,
    /// The put's own round trip, a consumer waiting.
    put: Vec<f64>,
    exists: Vec<f64>,
    get: Vec<f64>,
    /// A put of a key nobody waits for.
    unwatched: Vec<f64>,
}

/// The measured loop: a notification and the producer's round trips, alternating which goes
/// first, after one unrecorded pass.
fn measure(
    args: &HandoffArgs,
    rt: &tokio::runtime::Runtime,
    producer: &Client,
    consumer: &Client,
) -> anyhow::Result<Times> {
    let value = vec![0x5a_u8; 64];
    let probe = b"hbench-notify-probe".to_vec();
    rt.block_on(producer.put(&probe, &workloads::value(PROBE_SIZE)))?;
    let mut buf = vec![0u8; PROBE_SIZE as usize];
    let plain = b"hbench-notify-unwatched".to_vec();
    let (mut notify, mut put, mut exists, mut get, mut unwatched) =
        (vec![], vec![], vec![], vec![], vec![]);
    // One unrecorded pass opens the connections.
    for rep in 0..=args.notify_reps {
        let key = format!("hbench-notify/{rep}").into_bytes();
        let (n, p, e, g, u) = rt.block_on(async {
            let refs = async {
                let t = Instant::now();
                ensure!(producer.exists(&probe).await?, "probe key missing");
                let e = t.elapsed().as_nanos() as f64;
                let t = Instant::now();
                let got = producer.get_into(&probe, &mut buf).await?;
                let g = t.elapsed().as_nanos() as f64;
                ensure!(got == Some(PROBE_SIZE as usize), "probe key missing");
                let t = Instant::now();
                producer.put(&plain, &value).await?;
                anyhow::Ok((e, g, t.elapsed().as_nanos() as f64))
            };
            if rep % 2 == 0 {
                let (n, p) = notify_once(producer, consumer, &key, &value).await?;
                let (e, g, u) = refs.await?;
                anyhow::Ok((n, p, e, g, u))
            } else {
                let (e, g, u) = refs.await?;
                let (n, p) = notify_once(producer, consumer, &key, &value).await?;
                anyhow::Ok((n, p, e, g, u))
            }
        })?;
        if rep > 0 {
            notify.push(n);
            put.push(p);
            exists.push(e);
            get.push(g);
            unwatched.push(u);
        }
    }
    rt.block_on(async {
        producer.remove(&probe).await?;
        producer.remove(&plain).await
    })?;
    Ok(Times {
        notify,
        put,
        exists,
        get,
        unwatched,
    })
}

/// The rows of one path: the references, the notification judged against `exists`, and the
/// put's own round trips.
fn push_rows(path: &str, times: &Times, report: &mut Report) {
    let exists = Row::from_times(PART, &format!("{path}: exists (reference)"), &times.exists);
    let get = Row::from_times(PART, &format!("{path}: 4 KiB get (reference)"), &times.get);
    let mut row = Row::from_times(
        PART,
        &format!("{path}: put's call to wait's return"),
        &times.notify,
    );
    let (over50, over99) = (row.p50_ns - exists.p50_ns, row.p99_ns - exists.p99_ns);
    row.verdict = Some(Verdict {
        text: format!(
            "exists + {} at p50, + {} at p99; goal ≤ exists + 50µs",
            fmt_signed_ns(over50),
            fmt_signed_ns(over99)
        ),
        ratio: None,
        met: over50 <= NOTIFY_SLACK_NS,
    });
    let put = Row::from_times(
        PART,
        &format!("{path}:   stage: the put's round trip (a consumer waiting)"),
        &times.put,
    );
    let unwatched = Row::from_times(
        PART,
        &format!("{path}:   the same put, of a key nobody waits for"),
        &times.unwatched,
    );
    report.rows.extend([exists, get, row, put, unwatched]);
}

/// A signed duration for the goal column.
fn fmt_signed_ns(ns: f64) -> String {
    if ns < 0.0 {
        format!("-{}", fmt_ns(-ns))
    } else {
        fmt_ns(ns)
    }
}
