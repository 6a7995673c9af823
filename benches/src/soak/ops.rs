//! The load's operations and the counters every task adds to.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use kvpool_client::ClientError;

use super::value::valid;

/// Most distinct error messages kept for the report.
const ERROR_KINDS: usize = 32;

/// The load's operations.
#[derive(Clone, Copy, Debug)]
pub(super) enum Op {
    Put,
    Get,
    BatchGet,
    Exists,
    Remove,
    BatchPut,
    SavePrefix,
    LoadPrefix,
    Commit,
    Abort,
    Abandon,
    Churn,
}

pub(super) const OPS: [Op; 12] = [
    Op::Put,
    Op::Get,
    Op::BatchGet,
    Op::Exists,
    Op::Remove,
    Op::BatchPut,
    Op::SavePrefix,
    Op::LoadPrefix,
    Op::Commit,
    Op::Abort,
    Op::Abandon,
    Op::Churn,
];

impl Op {
    pub(super) fn name(self) -> &'static str {
        match self {
            Op::Put => "put",
            Op::Get => "get",
            Op::BatchGet => "batch_get_into",
            Op::Exists => "exists",
            Op::Remove => "remove",
            Op::BatchPut => "batch_put_from",
            Op::SavePrefix => "save_prefix",
            Op::LoadPrefix => "load_prefix",
            Op::Commit => "alloc+write+commit",
            Op::Abort => "alloc+write+abort",
            Op::Abandon => "alloc+write, abandoned",
            Op::Churn => "connect+put+get+close",
        }
    }
}

/// Counters every task adds to.
#[derive(Default)]
pub(super) struct Stats {
    pub(super) ops: [AtomicU64; OPS.len()],
    pub(super) errors: [AtomicU64; OPS.len()],
    /// Values read and checked.
    pub(super) hits: AtomicU64,
    pub(super) misses: AtomicU64,
    pub(super) read_bytes: AtomicU64,
    pub(super) written_bytes: AtomicU64,
    pub(super) wrong: AtomicU64,
    pub(super) wrong_bytes: AtomicU64,
    pub(super) error_kinds: Mutex<BTreeMap<String, u64>>,
}

impl Stats {
    pub(super) fn total_ops(&self) -> u64 {
        self.ops.iter().map(|c| c.load(Relaxed)).sum()
    }

    pub(super) fn total_errors(&self) -> u64 {
        self.errors.iter().map(|c| c.load(Relaxed)).sum()
    }

    pub(super) fn record(&self, op: Op, r: Result<(), ClientError>) {
        self.ops[op as usize].fetch_add(1, Relaxed);
        if let Err(e) = r {
            self.error(op, &e.to_string());
        }
    }

    pub(super) fn error(&self, op: Op, what: &str) {
        self.errors[op as usize].fetch_add(1, Relaxed);
        let mut kinds = self.error_kinds.lock().unwrap_or_else(|e| e.into_inner());
        let key = format!(
            "{}: {}",
            op.name(),
            what.chars().take(100).collect::<String>()
        );
        if kinds.len() < ERROR_KINDS || kinds.contains_key(&key) {
            *kinds.entry(key).or_default() += 1;
        }
    }

    /// Counts one read of `key`: a miss (`None`) or bytes that must be a value written for it.
    pub(super) fn check(&self, key: &[u8], got: Option<&[u8]>) {
        match got {
            None => {
                self.misses.fetch_add(1, Relaxed);
            }
            Some(v) => {
                self.hits.fetch_add(1, Relaxed);
                self.read_bytes.fetch_add(v.len() as u64, Relaxed);
                if !valid(key, v) {
                    self.wrong.fetch_add(1, Relaxed);
                    self.wrong_bytes.fetch_add(v.len() as u64, Relaxed);
                }
            }
        }
    }
}
