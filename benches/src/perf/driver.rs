//! Timed measurement loops: every measurement runs for a fixed duration (after a short
//! warm-up that is not recorded) and stops by itself. When operations outlast the window (a
//! depth-8 batch of 32 MiB values on 16 connections), every loop runs on until each has
//! recorded one, the loops that already have one going on unrecorded so that the others'
//! operations still see the same load; when operations are shorter, this never happens.
//! Threads for synchronous work (memcpy, one-sided local reads), tokio tasks for everything
//! that goes through a socket. Operations and workers are borrowed, not consumed, so one set can be measured in
//! several slices (see [`compare`](super::compare)).

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

/// What one measurement saw: operations, bytes, the measured time and per-operation
/// latencies (nanoseconds).
#[derive(Clone)]
pub(crate) struct Measured {
    /// Operations counted.
    pub(crate) ops: u64,
    /// Payload bytes those operations moved.
    pub(crate) bytes: u64,
    /// Effective seconds: `ops` divided by the operation rate. For one loop, the time from the
    /// opening of its window to its last completion; loops running side by side add their rates.
    pub(crate) secs: f64,
    /// Per-operation latency in nanoseconds.
    pub(crate) hist: Histogram<u64>,
}

impl Measured {
    /// Nothing measured yet.
    pub(crate) fn empty() -> Measured {
        Measured {
            ops: 0,
            bytes: 0,
            secs: 0.0,
            hist: new_hist(),
        }
    }

    /// Payload throughput in GB/s (10^9 bytes per second).
    pub(crate) fn gbps(&self) -> f64 {
        if self.secs > 0.0 {
            self.bytes as f64 / self.secs / 1e9
        } else {
            0.0
        }
    }

    /// Operations per second.
    pub(crate) fn ops_per_s(&self) -> f64 {
        if self.secs > 0.0 {
            self.ops as f64 / self.secs
        } else {
            0.0
        }
    }

    /// Latency at `q` (0..=1) in nanoseconds.
    pub(crate) fn quantile_ns(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64
    }

    /// Adds a loop that ran at the same time (another thread or connection): rates add up.
    fn merge(&mut self, other: &Measured) {
        let rate = self.ops_per_s() + other.ops_per_s();
        self.ops += other.ops;
        self.bytes += other.bytes;
        self.secs = if rate > 0.0 {
            self.ops as f64 / rate
        } else {
            self.secs.max(other.secs)
        };
        // Both histograms have the same bounds, so adding cannot fail.
        let _ = self.hist.add(&other.hist);
    }

    /// Adds a measurement taken after this one (the next slice of the same workload).
    pub(crate) fn then(&mut self, other: &Measured) {
        self.ops += other.ops;
        self.bytes += other.bytes;
        self.secs += other.secs;
        let _ = self.hist.add(&other.hist);
    }
}

fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("valid histogram bounds")
}

/// The unrecorded warm-up before a window: a tenth of it, at most 10 ms (connections and
/// buffers are set up before, so this only has to get the loops going).
fn warmup(window: Duration) -> Duration {
    (window / 10).min(Duration::from_millis(10))
}

/// Longest the loops of one measurement wait past its end for a loop to record an operation.
const GRACE: Duration = Duration::from_secs(60);

/// What the loops of one measurement share.
struct Shared {
    /// Loops that have not recorded an operation yet.
    unrecorded: AtomicUsize,
    /// A loop failed: the others stop.
    failed: AtomicBool,
}

impl Shared {
    fn new(loops: usize) -> Arc<Shared> {
        Arc::new(Shared {
            unrecorded: AtomicUsize::new(loops),
            failed: AtomicBool::new(false),
        })
    }
}

/// What a loop does with its next operation.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Next {
    /// Runs and records it (if the loop's window is open).
    Record,
    /// Runs it without recording: load while another loop waits for its first record.
    Load,
    /// Stops.
    Stop,
}

/// Per-loop bookkeeping. A loop's window opens at its first completion after the common
/// start (so an operation straddling the start is neither counted nor lets idle time in),
/// counts every operation begun after that until the common end, and closes at the last
/// completion: long operations bias neither side of a comparison. A loop with nothing counted
/// at the end goes on until it has one, and the others keep it company (see [`Next`]).
struct Window {
    start: Instant,
    end: Instant,
    opened: Option<Instant>,
    last: Instant,
    m: Measured,
    shared: Arc<Shared>,
}

impl Window {
    fn new(start: Instant, window: Duration, shared: Arc<Shared>) -> Window {
        Window {
            start,
            end: start + window,
            opened: None,
            last: start,
            m: Measured::empty(),
            shared,
        }
    }

    fn record(&mut self, began: Instant, done: Instant, bytes: u64) {
        match self.opened {
            None if done >= self.start => self.opened = Some(done),
            Some(open) if began >= open => {
                if self.m.ops == 0 {
                    self.shared.unrecorded.fetch_sub(1, Ordering::AcqRel);
                }
                self.m.ops += 1;
                self.m.bytes += bytes;
                self.m
                    .hist
                    .saturating_record((done - began).as_nanos().max(1) as u64);
                self.last = done;
            }
            _ => {}
        }
    }

    /// What to do with an operation beginning at `now`.
    fn next(&self, now: Instant) -> Next {
        if self.shared.failed.load(Ordering::Acquire) || now >= self.end + GRACE {
            Next::Stop
        } else if now < self.end || self.m.ops == 0 {
            Next::Record
        } else if self.shared.unrecorded.load(Ordering::Acquire) > 0 {
            Next::Load
        } else {
            Next::Stop
        }
    }

    /// Runs `op`'s result through the bookkeeping: records it or, on error, stops the others.
    fn after(&mut self, next: Next, began: Instant, r: anyhow::Result<u64>) -> anyhow::Result<()> {
        match r {
            Ok(bytes) => {
                if next == Next::Record {
                    self.record(began, Instant::now(), bytes);
                }
                Ok(())
            }
            Err(e) => {
                self.shared.failed.store(true, Ordering::Release);
                Err(e)
            }
        }
    }

    fn finish(mut self) -> Measured {
        if let Some(open) = self.opened {
            self.m.secs = self.last.saturating_duration_since(open).as_secs_f64();
        }
        self.m
    }
}

/// A synchronous operation: returns the payload bytes it moved.
pub(crate) type ThreadOp<'a> = Box<dyn FnMut() -> anyhow::Result<u64> + Send + 'a>;

/// Runs one OS thread per operation in `ops`, each calling its operation until the window
/// closes.
pub(crate) fn run_threads(window: Duration, ops: &mut [ThreadOp<'_>]) -> anyhow::Result<Measured> {
    let start = Instant::now() + warmup(window);
    let shared = Shared::new(ops.len());
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = ops
            .iter_mut()
            .map(|op| {
                let shared = shared.clone();
                s.spawn(move || -> anyhow::Result<Measured> {
                    let mut w = Window::new(start, window, shared);
                    loop {
                        let began = Instant::now();
                        let next = w.next(began);
                        if next == Next::Stop {
                            break;
                        }
                        w.after(next, began, op())?;
                    }
                    Ok(w.finish())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("bench thread panicked"))?
            })
            .collect::<Vec<_>>()
    });
    let mut total = Measured::empty();
    for r in results {
        total.merge(&r?);
    }
    Ok(total)
}

/// One connection's loop body for [`run_tasks`].
pub(crate) trait Worker: Send + 'static {
    /// Performs one operation (one round trip, or one pipelined batch); returns the payload
    /// bytes it moved.
    fn op(&mut self) -> impl Future<Output = anyhow::Result<u64>> + Send;
}

/// Runs each worker as its own tokio task until the window closes, all windows aligned. The
/// workers are handed back afterwards (on success).
pub(crate) async fn run_tasks<W: Worker>(
    workers: &mut Vec<W>,
    window: Duration,
) -> anyhow::Result<Measured> {
    let start = Instant::now() + warmup(window);
    let shared = Shared::new(workers.len());
    let tasks: Vec<_> = std::mem::take(workers)
        .into_iter()
        .map(|mut worker| {
            let shared = shared.clone();
            tokio::spawn(async move {
                let mut w = Window::new(start, window, shared);
                loop {
                    let began = Instant::now();
                    let next = w.next(began);
                    if next == Next::Stop {
                        break;
                    }
                    let r = worker.op().await;
                    w.after(next, began, r)?;
                }
                anyhow::Ok((w.finish(), worker))
            })
        })
        .collect();
    let mut total = Measured::empty();
    for t in tasks {
        let (m, worker) = t.await??;
        total.merge(&m);
        workers.push(worker);
    }
    Ok(total)
}
