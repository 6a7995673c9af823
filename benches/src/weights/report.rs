//! The figures of `kvpool-bench weights`: one row per figure, its ratio to the reference of
//! the same run, and the report as a table and as JSON.

use std::time::Duration;

use kvpool_bench::units::{fmt_ns, fmt_size};
use serde_json::json;

use crate::perf::machine::Machine;
use crate::perf::render::table;

/// One figure: a throughput (median of its runs) or a latency (p50 and p99 of its runs).
pub(super) struct Row {
    pub(super) phase: &'static str,
    pub(super) what: String,
    pub(super) bytes: u64,
    pub(super) secs: Vec<f64>,
    pub(super) latency: bool,
    pub(super) vs: Option<Versus>,
}

/// A row's ratio to a reference of the same run.
pub(super) struct Versus {
    pub(super) name: String,
    /// The reference's median over the row's.
    pub(super) ratio: f64,
    /// The lowest and highest ratio of one run to the reference's run it alternated with,
    /// when both have the same number of runs.
    pub(super) range: Option<(f64, f64)>,
    pub(super) goal: Option<f64>,
}

impl Versus {
    /// The ratio a goal is judged by: the lowest pair's where there are pairs.
    fn judged(&self) -> f64 {
        self.range.map_or(self.ratio, |(lo, _)| lo)
    }

    fn met(&self) -> Option<bool> {
        self.goal.map(|g| self.judged() >= g)
    }

    fn describe(&self) -> String {
        let mut s = format!("{:.2}×", self.ratio);
        if let Some((lo, hi)) = self.range {
            s.push_str(&format!(" [{lo:.2}–{hi:.2}]"));
        }
        s.push_str(&format!(" {}", self.name));
        if let (Some(g), Some(met)) = (self.goal, self.met()) {
            let verdict = if met { "met" } else { "MISSED" };
            s.push_str(&format!(" (goal ≥{g}× by the lowest pair: {verdict})"));
        }
        s
    }
}

impl Row {
    pub(super) fn new(phase: &'static str, what: &str, bytes: u64, times: &[Duration]) -> Row {
        Row {
            phase,
            what: what.into(),
            bytes,
            secs: times.iter().map(Duration::as_secs_f64).collect(),
            latency: false,
            vs: None,
        }
    }

    pub(super) fn latency(mut self) -> Row {
        self.latency = true;
        self
    }

    fn quantile(&self, q: f64) -> f64 {
        let mut s = self.secs.clone();
        s.sort_by(f64::total_cmp);
        s.get(((s.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    }

    fn median(&self) -> f64 {
        self.quantile(0.5)
    }

    fn gbps(&self) -> f64 {
        self.bytes as f64 / self.median() / 1e9
    }

    /// Compares this row's median with `reference`'s (the same bytes), and each run with the
    /// reference's run it alternated with.
    pub(super) fn versus(mut self, name: &str, reference: &Row, goal: Option<f64>) -> Row {
        let pairs: Vec<f64> = reference
            .secs
            .iter()
            .zip(&self.secs)
            .map(|(r, s)| r / s)
            .collect();
        let range = (reference.secs.len() == self.secs.len() && !pairs.is_empty()).then(|| {
            pairs
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
                    (lo.min(x), hi.max(x))
                })
        });
        self.vs = Some(Versus {
            name: name.into(),
            ratio: reference.median() / self.median(),
            range,
            goal,
        });
        self
    }

    /// Whether the row missed its goal (judged by its lowest pair).
    pub(super) fn missed(&self) -> bool {
        self.vs.as_ref().and_then(Versus::met) == Some(false)
    }
}

/// Everything a run found.
pub(super) struct Report {
    pub(super) machine: Machine,
    pub(super) model: String,
    pub(super) rows: Vec<Row>,
    pub(super) notes: Vec<String>,
}

impl Report {
    pub(super) fn render(&self) -> String {
        let mut out = String::new();
        let mut phase = "";
        let header = [
            "what",
            "bytes",
            "runs",
            "median",
            "GB/s",
            "p99",
            "vs reference (same run)",
        ];
        let mut lines: Vec<Vec<String>> = Vec::new();
        let flush = |out: &mut String, lines: &mut Vec<Vec<String>>| {
            if !lines.is_empty() {
                out.push_str(&table(&header, lines));
                lines.clear();
            }
        };
        for r in &self.rows {
            if r.phase != phase {
                flush(&mut out, &mut lines);
                phase = r.phase;
                out.push_str(&format!("\n== {phase} ==\n"));
            }
            let ns = r.median() * 1e9;
            lines.push(vec![
                r.what.clone(),
                fmt_bytes(r.bytes),
                r.secs.len().to_string(),
                fmt_ns(ns),
                if r.latency {
                    "-".into()
                } else {
                    format!("{:.2}", r.gbps())
                },
                if r.latency {
                    fmt_ns(r.quantile(0.99) * 1e9)
                } else {
                    "-".into()
                },
                r.vs.as_ref().map_or("-".into(), Versus::describe),
            ]);
        }
        flush(&mut out, &mut lines);
        for n in &self.notes {
            out.push_str(&format!("  * {n}\n"));
        }
        out
    }

    pub(super) fn to_json(&self, args: &str) -> String {
        let rows: Vec<_> = self
            .rows
            .iter()
            .map(|r| {
                json!({
                    "phase": r.phase,
                    "what": r.what,
                    "bytes": r.bytes,
                    "secs": r.secs,
                    "median_s": finite(r.median()),
                    "gbps": if r.latency { None } else { finite(r.gbps()) },
                    "p99_s": if r.latency { finite(r.quantile(0.99)) } else { None },
                    "vs": r.vs.as_ref().map(|v| json!({
                        "reference": v.name,
                        "ratio": finite(v.ratio),
                        "ratio_min": v.range.and_then(|r| finite(r.0)),
                        "ratio_max": v.range.and_then(|r| finite(r.1)),
                        "goal": v.goal,
                        "met": v.met(),
                    })),
                })
            })
            .collect();
        let doc = json!({
            "machine": self.machine.json(),
            "args": args,
            "model": self.model,
            "rows": rows,
            "notes": self.notes,
        });
        let mut s = serde_json::to_string_pretty(&doc).expect("a Value always serialises");
        s.push('\n');
        s
    }
}

fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

fn fmt_bytes(n: u64) -> String {
    if n >= 1 << 30 {
        format!("{:.2}GiB", n as f64 / (1u64 << 30) as f64)
    } else if n >= 1 << 20 {
        format!("{:.1}MiB", n as f64 / (1u64 << 20) as f64)
    } else {
        fmt_size(n)
    }
}
