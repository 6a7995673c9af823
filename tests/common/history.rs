//! A history of puts and gets, and its check: every operation is recorded with the time it was
//! invoked and the time it completed (nanoseconds since the load began), its key, and what was
//! written or read. Values are self-describing ([`value_of`]): their first 8 bytes are the
//! version, the next 8 a hash of (key, version), the rest and the length derived from that hash,
//! so a read names exactly which write it returns, or is recognisably none.
//!
//! The check ([`History::check`]), per key: a read returns a miss, or the bytes of a write of
//! that key that was invoked before the read completed, and never a value older than one
//! acknowledged before the read began. "Older" is real-time order: write A is older than write
//! B when A was acknowledged before B was invoked. A write that failed (an error, a timeout) may
//! still have been applied, at any later time: it is never older than anything. Errors are
//! counted, not judged.

use std::collections::BTreeMap;

/// What an operation did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A put of `version`; `acked`: it returned Ok (else it failed, and may or may not be in).
    Put { version: u64, acked: bool },
    /// A get that found nothing.
    Miss,
    /// A get that returned these bytes.
    Value(Vec<u8>),
    /// A get that failed.
    ReadError,
}

/// One operation.
#[derive(Clone, Debug)]
pub struct Op {
    /// Which client issued it.
    pub client: u32,
    pub key: u32,
    /// Nanoseconds since the load began, when it was issued and when its answer came.
    pub invoke: u64,
    pub complete: u64,
    pub outcome: Outcome,
}

/// Every operation of a run, in no particular order.
#[derive(Clone, Debug, Default)]
pub struct History {
    pub ops: Vec<Op>,
}

/// What the check found wrong with a read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Violation {
    /// Bytes that are no value ever written to the key (torn, foreign, or corrupted), or the
    /// value of a write invoked only after the read completed.
    Unknown { read: usize, why: String },
    /// The value of write `version`, although write `newer` of the same key was invoked after
    /// it was acknowledged and was itself acknowledged before the read began.
    Stale {
        read: usize,
        version: u64,
        newer: u64,
    },
}

/// Counts over a history, and what the check found.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub puts_acked: u64,
    pub puts_failed: u64,
    pub hits: u64,
    pub misses: u64,
    pub read_errors: u64,
    pub violations: Vec<Violation>,
}

/// The hash a value of (key, version) is derived from (FNV-1a).
fn hash(key: u32, version: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in key.to_le_bytes().iter().chain(&version.to_le_bytes()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Value `version` of key number `key`: 16 to about 4 KiB, every byte derived from the two.
pub fn value_of(key: u32, version: u64) -> Vec<u8> {
    let h = hash(key, version);
    let len = 16 + (h >> 40) as usize % 4096;
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&version.to_le_bytes());
    v.extend_from_slice(&h.to_le_bytes());
    let mut x = h | 1;
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.push(x as u8);
    }
    v
}

/// The version `got` is a value of, if it is exactly [`value_of`] of `key` at that version.
pub fn version_of(key: u32, got: &[u8]) -> Result<u64, String> {
    if got.len() < 16 {
        return Err(format!("{} bytes, shorter than any value", got.len()));
    }
    let version = u64::from_le_bytes(got[..8].try_into().expect("8 bytes"));
    let want = value_of(key, version);
    if want.len() != got.len() {
        return Err(format!(
            "claims version {version}, which is {} bytes, but {} were read",
            want.len(),
            got.len()
        ));
    }
    match want.iter().zip(got).position(|(a, b)| a != b) {
        None => Ok(version),
        Some(at) => Err(format!(
            "claims version {version} but differs from byte {at}"
        )),
    }
}

impl History {
    /// Checks every read against the writes of its key (see the module's doc).
    pub fn check(&self) -> Report {
        let mut r = Report::default();
        // Per key: each write's version, invoke, and completion (None: failed, so it may
        // land at any time after it was invoked).
        let mut writes: BTreeMap<u32, BTreeMap<u64, (u64, Option<u64>)>> = BTreeMap::new();
        for op in &self.ops {
            match op.outcome {
                Outcome::Put { version, acked } => {
                    if acked {
                        r.puts_acked += 1;
                    } else {
                        r.puts_failed += 1;
                    }
                    let done = acked.then_some(op.complete);
                    writes
                        .entry(op.key)
                        .or_default()
                        .insert(version, (op.invoke, done));
                }
                Outcome::Miss => r.misses += 1,
                Outcome::Value(_) => r.hits += 1,
                Outcome::ReadError => r.read_errors += 1,
            }
        }
        let none = BTreeMap::new();
        for (i, op) in self.ops.iter().enumerate() {
            let Outcome::Value(got) = &op.outcome else {
                continue;
            };
            let ws = writes.get(&op.key).unwrap_or(&none);
            let version = match version_of(op.key, got) {
                Ok(v) => v,
                Err(why) => {
                    r.violations.push(Violation::Unknown { read: i, why });
                    continue;
                }
            };
            let Some(&(invoked, acked)) = ws.get(&version) else {
                let why = format!("version {version} was never written");
                r.violations.push(Violation::Unknown { read: i, why });
                continue;
            };
            if invoked > op.complete {
                let why = format!("version {version} was written only after the read completed");
                r.violations.push(Violation::Unknown { read: i, why });
                continue;
            }
            let Some(acked) = acked else {
                continue;
            };
            // The newest write, in real time, acknowledged before the read began: stale if it
            // was invoked after the returned one was acknowledged.
            let newer = ws
                .iter()
                .filter(|(_, (inv, done))| done.is_some_and(|d| d < op.invoke) && *inv > acked)
                .max_by_key(|(_, (inv, _))| *inv);
            if let Some((&newer, _)) = newer {
                r.violations.push(Violation::Stale {
                    read: i,
                    version,
                    newer,
                });
            }
        }
        r
    }

    /// One violation, told with the operations involved.
    pub fn describe(&self, v: &Violation) -> String {
        let show = |op: &Op| {
            format!(
                "client {} key {} [{:.3} s .. {:.3} s] {}",
                op.client,
                op.key,
                op.invoke as f64 / 1e9,
                op.complete as f64 / 1e9,
                match &op.outcome {
                    Outcome::Put { version, acked } =>
                        format!("put v{version} {}", if *acked { "ok" } else { "failed" }),
                    Outcome::Value(b) => match version_of(op.key, b) {
                        Ok(v) => format!("get -> v{v}"),
                        Err(_) => format!("get -> {} unknown bytes", b.len()),
                    },
                    other => format!("{other:?}"),
                }
            )
        };
        let put = |key: u32, version: u64| {
            self.ops
                .iter()
                .find(|o| {
                    o.key == key
                        && matches!(o.outcome, Outcome::Put { version: v, .. } if v == version)
                })
                .map(&show)
                .unwrap_or_default()
        };
        match v {
            Violation::Unknown { read, why } => format!("{}: {why}", show(&self.ops[*read])),
            Violation::Stale {
                read,
                version,
                newer,
            } => {
                let op = &self.ops[*read];
                format!(
                    "stale read: {}; returned {}; newer {}",
                    show(op),
                    put(op.key, *version),
                    put(op.key, *newer)
                )
            }
        }
    }
}
