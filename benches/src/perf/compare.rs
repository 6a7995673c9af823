//! Side-by-side measurements. The contenders of one comparison (kvpool and its references) run
//! in alternating slices of the window — A B C, C B A, A B C, C B A — so that drift of the
//! machine (a noisy neighbour, the memory bandwidth of a shared host) hits every contender
//! alike and the ratios stay meaningful. Each contender still gets the whole window in total.

use std::time::Duration;

use super::bare_quic::BareClient;
use super::baseline_client::{BaselineGet, BaselineSet};
use super::driver::{run_tasks, run_threads, Measured, ThreadOp, Worker};
use super::raw::{RawGet, RawPut};
use super::workloads::{KvGet, KvPut};

/// Slices each contender's window is cut into.
const ROUNDS: u32 = 4;

/// Any connection loop, so that contenders of different kinds can be alternated.
pub(crate) enum AnyWorker {
    /// kvpool get / batch get.
    KvGet(KvGet),
    /// kvpool put.
    KvPut(KvPut),
    /// memcached or redis get (pipelined when deeper than 1).
    BaselineGet(BaselineGet),
    /// memcached or redis set.
    BaselineSet(BaselineSet),
    /// Bare quinn request.
    Bare(BareClient),
    /// Raw TCP request for bytes (pipelined when deeper than 1).
    RawGet(RawGet),
    /// Raw TCP upload of bytes.
    RawPut(RawPut),
}

impl Worker for AnyWorker {
    async fn op(&mut self) -> anyhow::Result<u64> {
        match self {
            AnyWorker::KvGet(w) => w.op().await,
            AnyWorker::KvPut(w) => w.op().await,
            AnyWorker::BaselineGet(w) => w.op().await,
            AnyWorker::BaselineSet(w) => w.op().await,
            AnyWorker::Bare(w) => w.op().await,
            AnyWorker::RawGet(w) => w.op().await,
            AnyWorker::RawPut(w) => w.op().await,
        }
    }
}

/// The order of the contenders in slice `round`: forward, then backward.
fn order(round: u32, n: usize) -> Vec<usize> {
    if round % 2 == 0 {
        (0..n).collect()
    } else {
        (0..n).rev().collect()
    }
}

/// Measures every side (a set of connection loops) for `window` in total, alternating.
pub(crate) async fn interleave_tasks(
    sides: &mut [Vec<AnyWorker>],
    window: Duration,
) -> anyhow::Result<Vec<Measured>> {
    let slice = window / ROUNDS;
    let mut totals: Vec<Measured> = sides.iter().map(|_| Measured::empty()).collect();
    for round in 0..ROUNDS {
        for i in order(round, sides.len()) {
            let m = run_tasks(&mut sides[i], slice).await?;
            totals[i].then(&m);
        }
    }
    Ok(totals)
}

/// Measures every side (a set of threads) for `window` in total, alternating.
pub(crate) fn interleave_threads(
    sides: &mut [Vec<ThreadOp<'_>>],
    window: Duration,
) -> anyhow::Result<Vec<Measured>> {
    let slice = window / ROUNDS;
    let mut totals: Vec<Measured> = sides.iter().map(|_| Measured::empty()).collect();
    for round in 0..ROUNDS {
        for i in order(round, sides.len()) {
            let m = run_threads(slice, &mut sides[i])?;
            totals[i].then(&m);
        }
    }
    Ok(totals)
}
