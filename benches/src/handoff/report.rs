//! The figures of `kvpool-bench handoff`: one row per figure, the goal's verdict, and the
//! report as tables and as JSON.

use kvpool_bench::units::fmt_ns;
use serde_json::json;

use super::moves;
use crate::perf::driver::Measured;
use crate::perf::machine::Machine;
use crate::perf::render::table;

/// A goal and whether a figure met it.
pub(super) struct Verdict {
    pub(super) text: String,
    pub(super) ratio: Option<f64>,
    pub(super) met: bool,
}

/// One figure: latencies (p50, p99 in ns) and optionally a throughput.
pub(super) struct Row {
    pub(super) part: &'static str,
    pub(super) what: String,
    pub(super) samples: u64,
    pub(super) p50_ns: f64,
    pub(super) p99_ns: f64,
    pub(super) gbps: Option<f64>,
    pub(super) verdict: Option<Verdict>,
    /// Gets that missed or failed (the join and drain rows; never samples).
    pub(super) misses: Option<u64>,
    /// Bytes a move carried and its seconds, as the nodes reported them.
    pub(super) moved: Option<(u64, f64)>,
}

impl Row {
    pub(super) fn from_measured(part: &'static str, what: String, m: &Measured) -> Row {
        Row {
            part,
            what,
            samples: m.ops,
            p50_ns: m.quantile_ns(0.5),
            p99_ns: m.quantile_ns(0.99),
            gbps: None,
            verdict: None,
            misses: None,
            moved: None,
        }
    }

    pub(super) fn from_times(part: &'static str, what: &str, times: &[f64]) -> Row {
        Row {
            part,
            what: what.into(),
            samples: times.len() as u64,
            p50_ns: quantile(times, 0.5),
            p99_ns: quantile(times, 0.99),
            gbps: None,
            verdict: None,
            misses: None,
            moved: None,
        }
    }

    pub(super) fn gbps(mut self, bytes: u64) -> Row {
        self.gbps = Some(bytes as f64 / self.p50_ns);
        self
    }
}

/// `q` of `xs` (nearest rank); NaN when empty.
fn quantile(xs: &[f64], q: f64) -> f64 {
    let mut s = xs.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(((s.len() as f64 - 1.0) * q).round() as usize)
        .copied()
        .unwrap_or(f64::NAN)
}

/// Everything a run found.
pub(super) struct Report {
    pub(super) machine: Machine,
    pub(super) loadavg: Vec<String>,
    pub(super) rows: Vec<Row>,
    pub(super) notes: Vec<String>,
}

impl Report {
    pub(super) fn render(&self) -> String {
        let mut out = String::new();
        let mut parts: Vec<&str> = Vec::new();
        for r in &self.rows {
            if !parts.contains(&r.part) {
                parts.push(r.part);
            }
        }
        for part in parts {
            out.push_str(&format!("\n== {part} ==\n"));
            let rows: Vec<&Row> = self.rows.iter().filter(|r| r.part == part).collect();
            // The columns of moves only where a part has them.
            let moves = rows.iter().any(|r| r.moved.is_some() || r.misses.is_some());
            let mut header = vec!["what", "samples", "p50", "p99"];
            if moves {
                header.extend(["misses", "moved", "time"]);
            }
            header.extend(["GB/s", "goal"]);
            let lines: Vec<Vec<String>> = rows
                .iter()
                .map(|r| {
                    let mut l = vec![
                        r.what.clone(),
                        r.samples.to_string(),
                        fmt_ns(r.p50_ns),
                        fmt_ns(r.p99_ns),
                    ];
                    if moves {
                        l.push(r.misses.map_or("-".into(), |m| m.to_string()));
                        l.push(r.moved.map_or("-".into(), |(b, _)| moves::mib(b)));
                        l.push(r.moved.map_or("-".into(), |(_, s)| format!("{s:.2} s")));
                    }
                    l.push(r.gbps.map_or("-".into(), |g| format!("{g:.2}")));
                    l.push(r.verdict.as_ref().map_or("-".into(), |v| {
                        format!("{} ({})", v.text, if v.met { "met" } else { "MISSED" })
                    }));
                    l
                })
                .collect();
            out.push_str(&table(&header, &lines));
        }
        for n in &self.notes {
            out.push_str(&format!("  * {n}\n"));
        }
        out
    }

    pub(super) fn to_json(&self, args: &str) -> String {
        let finite = |x: f64| x.is_finite().then_some(x);
        let rows: Vec<_> = self
            .rows
            .iter()
            .map(|r| {
                json!({
                    "part": r.part,
                    "what": r.what,
                    "samples": r.samples,
                    "p50_s": finite(r.p50_ns / 1e9),
                    "p99_s": finite(r.p99_ns / 1e9),
                    "gbps": r.gbps.and_then(finite),
                    "misses": r.misses,
                    "moved_bytes": r.moved.map(|m| m.0),
                    "moved_s": r.moved.and_then(|m| finite(m.1)),
                    "goal": r.verdict.as_ref().map(|v| json!({
                        "text": v.text,
                        "ratio": v.ratio.and_then(finite),
                        "met": v.met,
                    })),
                })
            })
            .collect();
        let mut machine = self.machine.json();
        machine["loadavg"] = json!(self.loadavg);
        let doc = json!({
            "machine": machine,
            "args": args,
            "rows": rows,
            "notes": self.notes,
        });
        let mut s = serde_json::to_string_pretty(&doc).expect("a Value always serialises");
        s.push('\n');
        s
    }
}
