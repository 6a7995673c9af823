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
    /// This figure divided by the reference's: with several runs, the median run's ratio.
    pub(crate) ratio: f64,
    /// With several runs (`--pairs`): the smallest and largest ratio of one run's figure to
    /// the reference's in the same run.
    pub(crate) spread: Option<(f64, f64)>,
    /// The ratio the project aims for, when there is one (higher is better). With several runs
    /// it is met when the smallest ratio meets it.
    pub(crate) target: Option<f64>,
}

impl Ref {
    /// A ratio with no target.
    pub(crate) fn new(name: &str, ratio: f64) -> Ref {
        Ref {
            name: name.into(),
            ratio,
            spread: None,
            target: None,
        }
    }

    /// The ratio of `figure` to `reference`: of their totals, or, when both hold one figure
    /// per run of several (`--pairs`), each run's ratio to the other's same run, their median
    /// and spread. None when a reference is zero or the runs do not pair up.
    pub(crate) fn between(name: &str, figure: &Row, reference: &Row) -> Option<Ref> {
        let (f, r) = (figure.gbps?, reference.gbps.filter(|r| *r > 0.0)?);
        let mut out = Ref::new(name, f / r);
        if figure.runs.len() > 1 && figure.runs.len() == reference.runs.len() {
            let mut each: Vec<f64> = figure
                .runs
                .iter()
                .zip(&reference.runs)
                .filter(|(_, r)| **r > 0.0)
                .map(|(f, r)| f / r)
                .collect();
            if each.len() != figure.runs.len() {
                return None;
            }
            each.sort_by(f64::total_cmp);
            out.ratio = median(&each);
            out.spread = Some((each[0], each[each.len() - 1]));
        }
        Some(out)
    }

    /// The same ratio with a target to meet.
    pub(crate) fn aiming(mut self, target: f64) -> Ref {
        self.target = Some(target);
        self
    }

    /// Whether the target is met: by the smallest ratio when there were several runs.
    pub(crate) fn met(&self) -> Option<bool> {
        let worst = self.spread.map_or(self.ratio, |(lo, _)| lo);
        self.target.map(|t| worst >= t)
    }

    /// A ratio with a target to meet.
    pub(crate) fn with_target(name: &str, ratio: f64, target: f64) -> Ref {
        Ref {
            name: name.into(),
            ratio,
            spread: None,
            target: Some(target),
        }
    }

    /// "0.93× memcpy (target ≥0.9×: met)"; with several runs "0.93× [0.88–0.97] memcpy
    /// (target ≥0.9× by the smallest: MISSED)".
    pub(crate) fn describe(&self) -> String {
        let mut s = format!("{:.2}×", self.ratio);
        if let Some((lo, hi)) = self.spread {
            let _ = write!(s, " [{lo:.2}–{hi:.2}]");
        }
        let _ = write!(s, " {}", self.name);
        if let (Some(t), Some(met)) = (self.target, self.met()) {
            let verdict = if met { "met" } else { "MISSED" };
            let by = if self.spread.is_some() {
                " by the smallest"
            } else {
                ""
            };
            let _ = write!(s, " (target ≥{t}×{by}: {verdict})");
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
    /// Payload throughput of each run, when the figure is measured several times (`--pairs`):
    /// the n-th run of every contender of a shape ran in the same stretch of time.
    pub(crate) runs: Vec<f64>,
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
            runs: Vec::new(),
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

    /// Takes the figures of several runs: throughput, rate and latencies of them all
    /// together, and each run's throughput.
    pub(crate) fn measured_runs(mut self, runs: &[Measured]) -> Row {
        let mut all = Measured::empty();
        for m in runs {
            all.then(m);
        }
        self = self.measured(&all);
        if runs.len() > 1 {
            self.runs = runs.iter().map(Measured::gbps).collect();
        }
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

/// The median of sorted, non-empty `v`.
fn median(v: &[f64]) -> f64 {
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(runs: &[f64]) -> Row {
        let mut r = Row::new(Section::Tcp, "x", "get");
        r.gbps = Some(runs.iter().sum::<f64>() / runs.len() as f64);
        if runs.len() > 1 {
            r.runs = runs.to_vec();
        }
        r
    }

    #[test]
    fn ratios_of_several_runs_pair_each_run_with_its_reference_and_meet_by_the_smallest() {
        let kv = row(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        let base = row(&[1.0, 1.0, 2.0, 5.0, 4.0]);
        let r = Ref::between("memcached", &kv, &base).unwrap().aiming(1.0);
        // Per run: 1.0, 2.0, 1.5, 0.8, 1.25.
        assert_eq!(r.spread, Some((0.8, 2.0)));
        assert_eq!(r.ratio, 1.25);
        assert_eq!(r.met(), Some(false), "the smallest run misses");
        assert!(r.describe().contains("[0.80–2.00]"));
        assert!(r.describe().contains("MISSED"));
        let one = Ref::between("memcached", &row(&[2.0]), &row(&[1.6]))
            .unwrap()
            .aiming(1.0);
        assert_eq!((one.ratio, one.spread, one.met()), (1.25, None, Some(true)));
        assert!(Ref::between("m", &kv, &row(&[1.0, 0.0, 1.0, 1.0, 1.0])).is_none());
        assert!(Ref::between("m", &kv, &row(&[0.0])).is_none());
    }
}
