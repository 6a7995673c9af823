//! Results: rows of figures, each with its ratio to a reference measured in the same run,
//! printed as one table per section and written as JSON.

use std::fmt::Write as _;

use super::driver::Measured;
use super::machine::Machine;
use super::Section;
use kvpool_bench::units::{fmt_ns, fmt_rate, fmt_size};

/// A figure's ratio to a reference measured in the same run (same size, concurrency, depth).
#[derive(Clone, Debug)]
pub(crate) struct Ref {
    /// What it is compared with: "memcpy", "memcached", "bare quinn", ...
    pub(crate) name: String,
    /// This figure divided by the reference's.
    pub(crate) ratio: f64,
    /// The ratio the project aims for, when there is one (higher is better).
    pub(crate) target: Option<f64>,
}

impl Ref {
    /// A ratio with no target.
    pub(crate) fn new(name: &str, ratio: f64) -> Ref {
        Ref {
            name: name.into(),
            ratio,
            target: None,
        }
    }

    /// A ratio with a target to meet.
    pub(crate) fn with_target(name: &str, ratio: f64, target: f64) -> Ref {
        Ref {
            name: name.into(),
            ratio,
            target: Some(target),
        }
    }

    /// "0.93× memcpy (target ≥0.9×: met)".
    pub(crate) fn describe(&self) -> String {
        let mut s = format!("{:.2}× {}", self.ratio, self.name);
        if let Some(t) = self.target {
            let verdict = if self.ratio >= t { "met" } else { "MISSED" };
            let _ = write!(s, " (target ≥{t}×: {verdict})");
        }
        s
    }
}

/// One measured figure.
#[derive(Clone, Debug)]
pub(crate) struct Row {
    /// Section it belongs to.
    pub(crate) section: Section,
    /// What was measured: "kvpool", "memcpy", "redis", "bare quinn", ...
    pub(crate) system: String,
    /// The operation: "get", "put", "read_local", "alloc+free", ...
    pub(crate) op: String,
    /// Value size in bytes.
    pub(crate) size: Option<u64>,
    /// Concurrent connections (or threads).
    pub(crate) conns: Option<usize>,
    /// Requests per round trip (pipelining or batching depth).
    pub(crate) depth: Option<usize>,
    /// Payload throughput.
    pub(crate) gbps: Option<f64>,
    /// Operations (round trips) per second.
    pub(crate) ops_per_s: Option<f64>,
    /// Median latency of one operation.
    pub(crate) p50_ns: Option<f64>,
    /// 99th percentile latency of one operation.
    pub(crate) p99_ns: Option<f64>,
    /// Objects held (index section).
    pub(crate) objects: Option<u64>,
    /// Memory per object (index section).
    pub(crate) bytes_per_object: Option<f64>,
    /// Ratios to references.
    pub(crate) refs: Vec<Ref>,
}

impl Row {
    /// An empty row.
    pub(crate) fn new(section: Section, system: &str, op: &str) -> Row {
        Row {
            section,
            system: system.into(),
            op: op.into(),
            size: None,
            conns: None,
            depth: None,
            gbps: None,
            ops_per_s: None,
            p50_ns: None,
            p99_ns: None,
            objects: None,
            bytes_per_object: None,
            refs: Vec::new(),
        }
    }

    /// Sets size, concurrency and depth.
    pub(crate) fn shape(mut self, size: u64, conns: usize, depth: usize) -> Row {
        self.size = Some(size);
        self.conns = Some(conns);
        self.depth = Some(depth);
        self
    }

    /// Takes throughput, rate and latencies from a measurement.
    pub(crate) fn measured(mut self, m: &Measured) -> Row {
        self.gbps = Some(m.gbps());
        self.ops_per_s = Some(m.ops_per_s());
        self.p50_ns = Some(m.quantile_ns(0.5));
        self.p99_ns = Some(m.quantile_ns(0.99));
        self
    }

    /// Same size, concurrency and depth as `other`.
    pub(crate) fn same_shape(&self, other: &Row) -> bool {
        self.size == other.size && self.conns == other.conns && self.depth == other.depth
    }

    /// "system op", e.g. "kvpool get".
    pub(crate) fn label(&self) -> String {
        format!("{} {}", self.system, self.op)
    }

    fn brief(&self) -> String {
        let mut s = self.label();
        if let Some(v) = self.size {
            let _ = write!(s, " {}", fmt_size(v));
        }
        if let (Some(c), Some(d)) = (self.conns, self.depth) {
            let _ = write!(s, " conns={c} depth={d}");
        }
        if let Some(g) = self.gbps {
            let _ = write!(s, ": {g:.2} GB/s");
        }
        if let Some(r) = self.ops_per_s {
            let _ = write!(s, " {}ops/s", fmt_rate(r));
        }
        if let Some(p) = self.p99_ns {
            let _ = write!(s, " p99 {}", fmt_ns(p));
        }
        if let Some(b) = self.bytes_per_object {
            let _ = write!(s, ": {b:.1} B/object");
        }
        for r in &self.refs {
            let _ = write!(s, ", {}", r.describe());
        }
        s
    }
}

/// Every row and note of a run.
pub(crate) struct Report {
    /// Where and when.
    pub(crate) machine: Machine,
    /// The figures, in the order measured.
    pub(crate) rows: Vec<Row>,
    /// Remarks per section (skips, caveats, missed targets explained).
    pub(crate) notes: Vec<(Section, String)>,
}

impl Report {
    /// An empty report for this machine.
    pub(crate) fn new(machine: Machine) -> Report {
        Report {
            machine,
            rows: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// Adds a row and shows it as progress on stderr.
    pub(crate) fn push(&mut self, row: Row) {
        eprintln!("  {}", row.brief());
        self.rows.push(row);
    }

    /// Adds a remark to a section and shows it on stderr.
    pub(crate) fn note(&mut self, section: Section, text: impl Into<String>) {
        let text = text.into();
        eprintln!("  note: {text}");
        self.notes.push((section, text));
    }

    /// The row of `section` for `system` and `op` with the shape of `like`.
    pub(crate) fn find(
        &self,
        section: Section,
        system: &str,
        op: &str,
        like: &Row,
    ) -> Option<&Row> {
        self.rows.iter().find(|r| {
            r.section == section && r.system == system && r.op == op && r.same_shape(like)
        })
    }
}
